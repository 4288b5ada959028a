from helixserve.cli import main

raise SystemExit(main())
