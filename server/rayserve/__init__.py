"""Archives on Ray Serve (docs/ray.md): one Serve deployment per model version, behind an ingress
that answers mserve's own paths.

``plan`` reads archives into deployment plans and imports no Ray; ``replica``, ``ingress`` and
``app`` need ``ray[serve]`` (the ``mserve[ray]`` extra), and only they import it, so ``import
server`` keeps working without Ray.
"""
