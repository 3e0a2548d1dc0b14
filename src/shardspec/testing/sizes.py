"""The model sizes random checkpoints are made in: a tiny Qwen3.5 text config (dense or
mixture-of-experts) for tests, and the released sizes' shapes for benchmarks."""

from __future__ import annotations

from collections.abc import Callable


def _layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5 hybrid pattern: every `interval`-th layer is full attention."""
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def tiny_config(**overrides) -> dict:
    """Small Qwen3.5 text config: head counts divide by 1, 2 and 4; GQA and grouped GDN heads."""
    config = {
        "model_type": "qwen3_5_text",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": _layer_types(4),
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
        "mtp_num_hidden_layers": 1,
    }
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        overrides = {**overrides, "layer_types": _layer_types(overrides["num_hidden_layers"])}
    config.update(overrides)
    return config


# Shapes from the text_config of the public Hugging Face config.json files of Qwen/Qwen3.5-9B,
# Qwen/Qwen3.5-27B and Qwen/Qwen3.5-35B-A3B; the 9B values are also transformers 5.24's
# Qwen3_5TextConfig defaults. What the released sizes share:
RELEASE_SHAPES = dict(
    vocab_size=248320,
    head_dim=256,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=262144,
    eos_token_id=248044,
    dtype="bfloat16",
)


def nine_b_config() -> dict:
    """Qwen3.5-9B text shapes."""
    return tiny_config(**RELEASE_SHAPES, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32)


def twenty_seven_b_config() -> dict:
    """Qwen3.5-27B text shapes."""
    return tiny_config(**RELEASE_SHAPES, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                       num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48)


def tiny_moe_config(**overrides) -> dict:
    """The tiny config with a mixture of experts in every MLP: 8 experts, top 3; widths that divide
    by 1, 2 and 4 (and stay multiples of 8 per rank, as grouped matmuls need)."""
    config = tiny_config(model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=3,
                         moe_intermediate_size=32, shared_expert_intermediate_size=48)
    del config["intermediate_size"]
    config.update(overrides)
    return config


def thirty_five_b_a3b_config() -> dict:
    """Qwen3.5-35B-A3B text shapes (hidden 2048, 40 layers, 256 experts, top 8, widths 512)."""
    return tiny_moe_config(**RELEASE_SHAPES, hidden_size=2048, num_hidden_layers=40, layer_types=_layer_types(40),
                           num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
                           num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                           shared_expert_intermediate_size=512)

# the names `python -m shardspec.testing.random_checkpoint --size` and the benchmarks take
SIZES: dict[str, Callable[[], dict]] = {"tiny": tiny_config, "9b": nine_b_config, "27b": twenty_seven_b_config,
                                        "tiny-moe": tiny_moe_config, "35b-a3b": thirty_five_b_a3b_config}
