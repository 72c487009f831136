"""Mixture-of-Experts FFNs; routers register themselves in ``xscale.models.registry.ROUTER``."""
