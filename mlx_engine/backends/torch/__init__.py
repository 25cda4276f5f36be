"""The PyTorch backend (optional extra `torch`): a model runner on CUDA or the CPU under the shared
scheduler, sampling, speculative decoding and block-pool bookkeeping. The only package that imports torch."""

from mlx_engine.backends.torch.runner import TorchRunner

__all__ = ["TorchRunner"]
