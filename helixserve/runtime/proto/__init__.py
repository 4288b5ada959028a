"""Generated from proto/helix.proto by `python -m helixserve.runtime.gen_proto`."""
