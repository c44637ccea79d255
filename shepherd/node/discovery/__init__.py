"""Worker discovery from Kubernetes (``--service-discovery``): ``pods.PodTracker`` turns pod events into
worker add/remove decisions (pure, no I/O); ``kube.PodDiscovery`` lists and watches the pods through
lightkube (the optional ``k8s`` extra) and applies the decisions through the admin API's path
(``WorkerRegistry.add`` / ``remove``, PD pools), so the mesh replicates what one node discovers. Started
by ``shepherd.node.app``.
"""

__all__ = ["kube", "pods"]
