from helixserve.cli import main

# guarded: worker processes (planner/parallel.py) must never run the CLI again
if __name__ == "__main__":
    raise SystemExit(main())
