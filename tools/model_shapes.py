"""Config blocks of the released Inkling-Small and Inkling (spec/inkling-text.md 1.5, 1.6) in raw config.json keys,
for what needs the real shapes without weights: the memory-plan tests and the benchmarks (pass them to
`tools.make_tiny_checkpoint.raw_config`)."""

INKLING_SMALL = {
    "hidden_size": 4096,
    "num_hidden_layers": 42,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "swa_num_attention_heads": 32,
    "swa_num_key_value_heads": 8,
    "swa_head_dim": 128,
    "sliding_window_size": 512,
    "d_rel": 16,
    "rel_extent": 1024,
    "log_scaling_n_floor": 128000,
    "local_layer_ids": [i for i in range(42) if (i + 1) % 6],
    "dense_mlp_idx": 2,
    "dense_intermediate_size": 16384,
    "intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "logits_mup_width_multiplier": 16.0,
}
INKLING = INKLING_SMALL | {
    "hidden_size": 6144,
    "num_hidden_layers": 66,
    "num_attention_heads": 64,
    "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 16,
    "local_layer_ids": [i for i in range(66) if (i + 1) % 6],
    "dense_intermediate_size": 24576,
    "intermediate_size": 3072,
    "logits_mup_width_multiplier": 24.0,
}
# the MTP block of both releases (spec 1.5): 8 depths, depths 1 and 3 global
INKLING_MTP = {"num_nextn_predict_layers": 8, "chain_hidden_post_norm": False, "local_layer_ids": [0, 2, 4, 5, 6, 7]}
