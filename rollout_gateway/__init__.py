"""The composition root: the ``rollout-gateway`` command, assembled from the layers below."""
