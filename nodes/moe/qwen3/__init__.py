"""The pack's own Qwen3-MoE (and Qwen2-MoE) model: sync-free experts on the shared MoE kernels.

model.py (config, layers, the LM and its generation), loader.py (files -> model), tokenizer.py.
"""
from .loader import LoadedMoE, build_model, from_state_dict, infer_config, load, random_model
from .model import (SUPPORTED_MODEL_TYPES, Attention, DecoderLayer, DenseMLP, KVCache, ModelLoadError, MoEConfig,
                    Qwen3MoeLM, RMSNorm, SparseMoE, sample_next)
from .tokenizer import Tokenizer

__all__ = ["LoadedMoE", "build_model", "from_state_dict", "infer_config", "load", "random_model",
           "SUPPORTED_MODEL_TYPES", "Attention", "DecoderLayer", "DenseMLP", "KVCache", "ModelLoadError", "MoEConfig",
           "Qwen3MoeLM", "RMSNorm", "SparseMoE", "sample_next", "Tokenizer"]
