"""This node's part in the mesh: ``mesh_node.MeshNode`` wires the mesh's state and runtime to the
gateway's workers, routing and rate limits; ``key_sync.KeySync`` links the API-key store to the
mesh's control-plane document. Used by ``shepherd.node.app`` and the mesh/keys routes.
"""

__all__ = ["key_sync", "mesh_node"]
