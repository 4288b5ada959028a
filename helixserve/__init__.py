"""helixserve: serve one large language model from a cluster of mixed GPU machines."""

__version__ = "0.1.0"
