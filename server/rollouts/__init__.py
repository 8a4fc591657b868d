"""Changing a model's traffic while it serves: the split between its versions, stickiness, the
canary rollout (docs/rollouts.md). Every inference frontend picks its model version through
:class:`server.rollouts.router.Router`."""
