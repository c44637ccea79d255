"""Contract tests: the node against what real engine servicers send, replayed message by message
(``replay``: SMG's SGLang and vLLM servicers, SGLang's in-tree gRPC server, vLLM's gRPC entrypoint;
the TensorRT-LLM and MLX fakes: ``fake_trtllm``, ``fake_mlx``)."""
