"""This node's part in the mesh: ``mesh_node.MeshNode`` wires the mesh's state and runtime to the
gateway's workers, routing and rate limits; ``key_sync.KeySync`` links the API-key store to the
mesh's control-plane document; ``history`` builds the node's history store (routed to the owner node
over the mesh with an embedded backend, ``RoutedStore``) and its retention; ``key_journal.KeyJournal``
keeps the API keys across restarts, ``worker_journal.WorkerJournal`` the workers added through the
API. Used by ``shepherd.node.app`` and the mesh/keys/conversations routes.
"""

__all__ = ["history", "key_journal", "key_sync", "mesh_node", "worker_journal"]
