"""Rehearse a cluster at full size on one host (`helixserve rehearse`, docs/rehearse.md).

One EMULATED worker per placed node (helixserve/engine/emulated.py: GPU times from measured
profiles, real KV accounting and activation sizes), the links of the cluster file in a
userspace proxy (`links.py`), the real coordinator, OpenAI API, gRPC and mutual TLS
(`cluster.py`); the trace through the HTTP API with the bench client and the simulator on the
same placement and trace (`run.py`), one report (`rehearsal.py`, `report.py`).
"""
