"""The table of docs/compatibility.md, with the tests behind each row.

    python tests/compatibility.py > docs/compatibility.md

tests/test_compatibility_doc.py fails when the file differs from this table or when a row names
a test that does not exist, so the document cannot drift from the tests (which CI runs).
"""

WORKS, REFUSED, GPU_ONLY = "works", "refused at start-up", "GPU only, not in CI"

# (composition, status, what is checked, tests)
ROWS = [
    (
        "Activation checkpointing `none`, `selective` op, `selective` layer, `full`",
        WORKS,
        "trainer losses equal the default run's within 1e-4",
        ["test_train.py::test_composition_trains_with_the_same_losses"],
    ),
    (
        "`fsdp_reshard_after_forward` `default`, `always`, `never`",
        WORKS,
        "trainer losses equal the default run's within 1e-4",
        ["test_train.py::test_composition_trains_with_the_same_losses"],
    ),
    (
        "HSDP (`data_parallel_replicate_degree` x `data_parallel_shard_degree`)",
        WORKS,
        "2 x 2 on 4 ranks trains; the plan shards over the shard dim only",
        ["test_train.py::test_hsdp_replicate_x_shard"],
    ),
    (
        "Pipeline parallelism (`pipeline_parallel_degree`), with FSDP",
        WORKS,
        "PP 2 x FSDP 2, 1F1B: losses within 0.01 of bf16 PP",
        ["test_train.py::test_pipeline_parallel_with_fsdp_tracks_bf16"],
    ),
    (
        "Tensor parallelism (`tensor_parallel_degree` > 1), with FSDP; expert-tensor "
        "parallelism (`expert_tensor_parallel_degree` = TP)",
        WORKS,
        "loss within 5e-4 and expert gradients above 25 dB of the unsharded converted model; "
        "plan = real sharding; trainer losses within 0.02 of bf16 TP (routed, FeedForward and "
        "grouped shared experts)",
        [
            "test_parallel.py::test_parallelism_matches_unsharded_converted_model",
            "test_parallel.py::test_shard_plan_matches_the_real_sharding",
            "test_train_parallel.py::test_parallelism_trains_tracking_bf16",
            "test_converter.py::test_tensor_parallel_plan_rows",
        ],
    ),
    (
        "Expert parallelism (`expert_parallel_degree` > 1), with FSDP (dim-1 sharding when "
        "efsdp x EP exceeds the experts), with ETP, and TP borrowed for EP",
        WORKS,
        "as for TP; the dim-1 case trains with the plan's shard dim",
        [
            "test_parallel.py::test_parallelism_matches_unsharded_converted_model",
            "test_parallel.py::test_shard_plan_matches_the_real_sharding",
            "test_train_parallel.py::test_parallelism_trains_tracking_bf16",
            "test_converter.py::test_shard_plan_with_expert_parallelism",
        ],
    ),
    (
        "Tensor parallelism with pipeline parallelism (the Maverick preset's shape)",
        WORKS,
        "TP 2 x PP 2 trainer losses within 0.02 of bf16",
        ["test_train_parallel.py::test_parallelism_trains_tracking_bf16"],
    ),
    (
        "torch.compile with TP 2 x FSDP 2 or EP 2 x FSDP 4; HSDP (2 x 2) with TP 2",
        WORKS,
        "trainer losses within 0.02 of bf16 with the same parallelism, traced whole by dynamo "
        "and AOTAutograd (`compile.backend = aot_eager`), not lowered by inductor on CPU; a TP "
        "run compiled with inductor, launched again on the same compile cache folder, trains "
        "the same (torch's compile caches are off under TP: pytorch/pytorch#176532 otherwise "
        "trains the second launch on wrong losses)",
        [
            "test_train_parallel.py::test_parallelism_trains_tracking_bf16",
            "test_train_parallel.py::"
            "test_compiled_tensor_parallel_command_trains_the_same_when_launched_again",
        ],
    ),
    (
        "torch.compile launches sharing a compile cache folder: after an edit or upgrade of "
        "float8_moe, and an fp8 launch after a bf16 one (expert weights as DTensors)",
        WORKS,
        "each launch's compiled forward and backward equal its own eager ones; the same code "
        "and conversion still load the cached graph (`convert` tags torch's cache keys with "
        "the package's source and the converted weights; without the tag the edited launch "
        "ran the old graph and the fp8 launch crashed in the bf16 one)",
        [
            "test_compile_cache.py::test_a_launch_of_edited_code_compiles_its_own",
            "test_compile_cache.py::test_an_fp8_launch_after_a_bf16_one_compiles_its_own",
        ],
    ),
    (
        "Tensor parallelism with the model compiled, on CPU, other than with FSDP and AC "
        "`none` or selective per layer: `selective` op or `full` activation checkpointing, or "
        "TP without FSDP",
        REFUSED,
        "fails in torch 2.13 itself on CPU (bf16 too); not tried on GPUs; the error names the "
        "options that train",
        ["test_converter.py::test_tensor_parallel_compile_is_refused_on_cpu_where_torch_fails"],
    ),
    (
        "Expert parallelism with `selective` op activation checkpointing, on CPU",
        REFUSED,
        "fails in torchtitan 0.2.2 itself on CPU (bf16 too); trains on 2 H200s; the error names "
        "the options",
        ["test_converter.py::test_expert_parallel_selective_op_ac_is_refused_on_cpu"],
    ),
    (
        "`quantize.linear.float8` / `quantize.linear.mx` on the dense layers",
        WORKS,
        "both converters run once the shared experts are in their `filter_fqns`; a FeedForward "
        "claimed by both is refused",
        ["test_converter.py::test_float8_linear_converter_claiming_shared_experts_is_refused"],
    ),
    (
        "torch.compile (torchtitan's per-block `fullgraph=True`)",
        WORKS,
        "compiled = eager exactly (routed experts lowered by inductor, shared experts traced "
        "by dynamo and AOTAutograd), with the lazy bf16 cast of fp32 weights in both; a lazy "
        "cast cannot cross a graph break (a clear error; `WeightConfig(lazy_cast=False)` copies); "
        "trainer within 0.005 (whole model, inductor, CPU). On an H200 the compiled trainer logs "
        "eager's losses (`test_cuda.py::test_compiled_chunked_per_group_cast_equals_eager`) and "
        "keeps no copy of the weight "
        "(`test_cuda.py::test_compiled_lazy_cast_keeps_no_weight_copy`)",
        [
            "test_compile.py::test_compiled_experts_equal_eager",
            "test_lazy_cast.py::test_compiled_casts_are_lazy_inside_one_graph",
            "test_train.py::test_default_config_trains_stock_llama4_eager_and_compiled",
        ],
    ),
    (
        "Any FSDP world size, uneven dim 0 (the seed: `[1, H, D]` on 8 ranks)",
        WORKS,
        "sharded = unsharded within 1e-5 at world 1-8; plan = FSDP2's chunking (hypothesis)",
        [
            "test_fsdp_uneven.py::test_uneven_fsdp_matches_unsharded",
            "test_fsdp_uneven.py::test_seed_shape_pads_seven_of_eight_ranks",
            "test_shard_properties.py::test_plan_and_all_gather_padding_match_fsdp_chunking",
            "test_train.py::test_seed_layout_trains_on_8_ranks",
        ],
    ),
    (
        "World size larger than every weight dimension",
        WORKS,
        "`tiny_routed` weights `[2, 6, 4]` at world sizes 1-8 (8 exceeds every dim)",
        ["test_fsdp_uneven.py::test_uneven_fsdp_matches_unsharded"],
    ),
    (
        "Gradient accumulation",
        WORKS,
        "2 micro-batches a step in every FSDP case",
        ["test_fsdp_uneven.py::test_uneven_fsdp_matches_unsharded"],
    ),
    (
        "`fp8_all_gather` (shards quantized before FSDP's all-gather), with FSDP, uneven "
        "dim 0, `cache_fp8_weights`, resharding on or off, activation checkpointing, "
        "torch.compile",
        WORKS,
        "bit-identical to the bf16 gather at world 2 and 3 (emulated) and on an H200 (Triton "
        "kernels, hooks driven by hand); trainer losses equal, eager and compiled (dynamo and "
        "AOTAutograd; the gathered GEMM lowered by inductor equals eager); 2D FeedForward "
        "weights and FSDP on dim 1 gather bf16, as the plan logs",
        [
            "test_fp8_all_gather.py::test_fp8_all_gather_matches_bf16",
            "test_fp8_all_gather.py::test_shard_plan_logs_fp8_and_bf16_fallbacks",
            "test_train.py::test_fp8_all_gather_trains_exactly_like_the_bf16_gather",
            "test_compile.py::test_compiled_fp8_gathered_weight_equals_eager",
            "test_cuda.py::test_fp8_all_gather_on_cuda_equals_the_unsharded_weight",
        ],
    ),
    (
        "`fp8_all_gather` with `mixed_precision_param` other than bf16",
        REFUSED,
        "torchtitan's experts cast the weights to bf16, which needs the values; the error names "
        "both options",
        ["test_fp8_all_gather.py::test_fp8_all_gather_refuses_another_all_gather_dtype"],
    ),
    (
        "`cache_fp8_weights` (fp8 weight cache)",
        WORKS,
        "one quantization per orientation per step; bit-identical results; trainer losses equal",
        [
            "test_weight_cache.py::test_cache_quantizes_each_weight_once_per_step",
            "test_weight_cache.py::test_cache_follows_in_place_changes_and_clears",
            "test_weight_cache.py::test_cache_never_serves_a_stale_copy_after_a_write",
            "test_weight_cache.py::test_cache_after_a_checkpoint_load",
            "test_train.py::test_composition_trains_with_the_same_losses",
        ],
    ),
    (
        "Resume after a killed run (SIGKILL, SIGTERM, a save cut short or failing to write)",
        WORKS,
        "resumes from the last complete checkpoint on disk with the uninterrupted run's losses",
        [
            "test_train.py::test_killed_run_resumes_from_its_last_checkpoint",
        ],
    ),
    (
        "Checkpoint written at 8 ranks, loaded at 3 or 2",
        WORKS,
        "same loss on a fixed batch; torchtitan resumes at 3 ranks with "
        "`--checkpoint.exclude_from_loading=dataloader` (it cannot reshard the data loader)",
        [
            "test_train.py::test_checkpoint_from_8_ranks_gives_the_same_loss_at_3_and_2",
            "test_train.py::test_training_resumes_at_3_ranks_from_an_8_rank_checkpoint",
        ],
    ),
    (
        "Checkpoint written under TP 2 x FSDP 2 or EP 2 x FSDP 4, loaded under FSDP only, and "
        "the other way round",
        WORKS,
        "the loading run's next loss equals the writing run's within 0.002 (same data-parallel "
        "degree, so the data loader state loads too)",
        ["test_train_parallel.py::test_checkpoint_loads_under_another_parallelism"],
    ),
    (
        "`DTensor.full_tensor()` of a converted weight (ranks holding only padding included)",
        WORKS,
        "the whole unpadded weight, still converted, equal to the unsharded one, world 1-8",
        ["test_fsdp_uneven.py::test_uneven_fsdp_matches_unsharded"],
    ),
    (
        "Checkpoint loaded without the plugin",
        WORKS,
        "plain float32 tensors, identical values",
        ["test_train.py::test_checkpoints_hold_plain_tensors_and_load_either_way"],
    ),
    (
        "Unknown `recipe`; an `fqns` entry matching nothing; a setting of another type "
        '(`emulate = "false"`); no `[float8_moe]` section',
        REFUSED,
        "error names the value and what to set",
        [
            "test_converter.py::test_bad_recipe_is_a_clear_error",
            "test_converter.py::test_unmatched_fqns_name_the_modules_looked_at",
            "test_converter.py::test_an_fqns_entry_matching_nothing_is_refused_beside_one_that_matches",
            "test_converter.py::test_toml_settings_of_another_type_are_refused",
            "test_converter.py::test_missing_config_section_is_a_clear_error",
        ],
    ),
    (
        "Other MoE models: DeepSeek-V3, Qwen3-MoE (CPU); GPT-OSS experts (numerics; its trainer "
        "needs FlexAttention's backward, GPU only); a user's own module of the same shape",
        WORKS,
        "trainer losses within 0.03 of bf16; SQNR bars; structural recognition",
        [
            "test_models.py::test_debug_model_trains_in_fp8_tracking_bf16",
            "test_models.py::test_gpt_oss_experts_sqnr_vs_float32",
            "test_models.py::test_users_own_moe_module_converts_by_structure",
        ],
    ),
    (
        "Token groups of zero tokens",
        WORKS,
        "an empty expert in every routed FSDP case",
        ["test_fsdp_uneven.py::test_uneven_fsdp_matches_unsharded"],
    ),
    (
        "NaN / Inf in activations or weights",
        WORKS,
        "only the affected row / column is non-finite, everything else exact; the loss is NaN",
        [
            "test_numerics.py::test_non_finite_activation_poisons_only_its_row",
            "test_numerics.py::test_non_finite_weight_poisons_only_its_output_column",
            "test_numerics.py::test_non_finite_weight_gives_a_nan_loss_in_llama4",
        ],
    ),
    (
        "A matmul form without an fp8 path; fp8 kernels missing",
        REFUSED,
        "raises instead of running in bf16, also after any chain of views (hypothesis)",
        [
            "test_numerics.py::test_unsupported_call_form_raises_instead_of_bf16",
            "test_numerics.py::test_non_emulated_weight_without_fp8_kernels_raises",
            "test_fail_closed.py::test_unsupported_call_form_raises",
            "test_fail_closed.py::test_view_chains_then_matmul_are_fp8_or_raise",
        ],
    ),
    (
        "Real fp8 kernels on CUDA (sm89+), torch.compile on GPU, 2 GPUs over NCCL",
        GPU_ONLY,
        "run on H200s; results and commands in docs/benchmarks/README.md",
        [
            "test_cuda.py::test_cuda_kernels_match_emulation",
            "test_cuda.py::test_rowwise_kernel_matches_the_torch_rules",
        ],
    ),
    (
        "Token counts not a multiple of 16 on CUDA",
        "works (CUDA path on CPU, in CI; the GPU test passed on an H200, 2026-12-05)",
        "routed: the converter sets torchtitan's token-group alignment to 16 (128 for `recipe = "
        '"blockwise"`, so that no 128-token block of the weight gradient straddles two groups), '
        "so torchtitan pads the routed groups; shared experts: the weight-gradient casts add "
        "zero rows to a multiple of 16 (torch's `_scaled_mm` rule; they failed at the first "
        "backward before); 3D x 3D batches of several entries of such counts: refused with the "
        "rule where the weight gets a gradient",
        [
            "test_cuda_path_interpreted.py::test_call_forms_on_the_cuda_path_equal_the_emulated_path",
            "test_cuda.py::test_cuda_kernels_match_emulation",
        ],
    ),
    (
        "The CUDA code path (our kernels, the fp8 GEMMs' layouts and group ends, padding rows, "
        "the fp8 all-gather's CUDA quantizers, torchtitan's MoE layer)",
        "works, checked on CPU in CI",
        "kernels in Triton's interpreter with the GPU's fp8 rounding, torch's fp8 GEMMs as CUDA "
        "defines them, poisoned `torch.empty`: equal to the emulated path",
        [
            "test_cuda_path_interpreted.py::test_call_forms_on_the_cuda_path_equal_the_emulated_path",
            "test_cuda_path_interpreted.py::test_fp8_all_gather_on_the_cuda_path_equals_the_unsharded_weight",
            "test_cuda_path_interpreted.py::test_torchtitan_moe_layers_on_the_cuda_path_equal_the_emulated_path",
        ],
    ),
    (
        '`recipe = "rowwise"` (the default) through the recipe seam (`fp8/recipes/`)',
        WORKS,
        "forward, input and weight gradients bit-identical to the rowwise fp8 ops called "
        "directly (and to the code before the seam); every other row of this table runs it",
        [
            "test_recipe_rowwise_seam.py::test_rowwise_through_the_seam_is_bit_identical_to_its_fp8_ops"
        ],
    ),
    (
        "A recipe added as one folder and one line of the registry (`register_recipe`): a "
        "per-tensor recipe of the tests, emulated",
        WORKS,
        "converts torchtitan's Llama4 debug model by its name, trains a step within the SQNR "
        "bars of an fp32 reference; an unknown recipe is refused naming the registered ones",
        [
            "test_recipe_registry.py::test_a_registered_recipe_converts_and_trains_against_fp32",
            "test_recipe_registry.py::test_the_registry_names_every_registered_recipe",
        ],
    ),
    (
        '`recipe = "blockwise"` (1x128 activation tiles, 128x128 weight blocks, 128x1 token '
        "tiles of each group for the weight gradient), emulated: routed (grouped, offsets, "
        "empty groups, ragged K / N / groups), grouped shared and FeedForward experts; "
        "torch.compile(fullgraph)",
        WORKS,
        "forward, input and weight gradients against a plain fp64 reference of the contract "
        "(1e-5); per-projection SQNR at least rowwise's on Gaussian data and 6 dB above it "
        "(output) with outlier channel blocks; compiled = eager bit for bit",
        [
            "test_blockwise.py::test_grouped_fwd_dgrad_wgrad_match_the_contract",
            "test_blockwise.py::test_dense_linear_matches_the_contract",
            "test_blockwise.py::test_blockwise_sqnr_at_least_rowwise_on_normal_data",
            "test_blockwise.py::test_blockwise_sqnr_clearly_higher_with_outlier_blocks",
            "test_blockwise.py::test_compiles_fullgraph_like_eager",
        ],
    ),
    (
        '`recipe = "blockwise"` with FSDP (uneven dim 0), `fp8_all_gather`, tensor parallelism '
        "at 128-aligned local shards; the Llama4 and DeepSeek-V3 debug models in the trainer",
        WORKS,
        "sharded = unsharded within 1e-5 at world 1-8 (FSDP); fp8 all-gather bit-identical to "
        "the bf16 gather at world 2 and 3; TP 2 loss within 5e-4 and expert gradients above 25 "
        "dB of the unsharded model; trainer losses within 0.03 of bf16",
        [
            "test_fsdp_uneven.py::test_uneven_fsdp_matches_unsharded",
            "test_fp8_all_gather.py::test_fp8_all_gather_matches_bf16",
            "test_blockwise_sharded.py::test_tensor_parallel_blockwise_matches_unsharded",
            "test_blockwise_train.py::test_debug_model_trains_blockwise_tracking_bf16",
        ],
    ),
    (
        '`recipe = "blockwise"` with a tensor-parallel or expert-tensor-parallel split off the '
        "128 grid (a local shard's split dim not a multiple of 128; a model dim off the grid "
        "that no split divides is planned)",
        REFUSED,
        "the converter (and so the preflight) names the weight, its local shape, the 128 rule "
        "and what to change",
        [
            "test_blockwise_sharded.py::test_tensor_parallel_split_off_the_block_grid_is_refused",
            "test_blockwise_sharded.py::test_an_expert_tensor_parallel_split_off_the_block_grid_is_refused",
            "test_blockwise_sharded.py::test_a_model_dim_off_the_block_grid_is_planned_under_ep_and_etp",
            "test_blockwise_sharded.py::test_preflight_checks_the_128_rule",
        ],
    ),
    (
        '`recipe = "blockwise"` emulated with the model compiled by inductor (`compile.backend '
        '= "inductor"`)',
        REFUSED,
        "inductor (torch 2.13, CPU) miscompiles the emulated blockwise GEMMs when the forward and "
        "both gradients compile together (dynamo and AOTAutograd alone give eager's results bit "
        'for bit); the error names `compile.backend = "aot_eager"` and the other ways out',
        ["test_blockwise.py::test_inductor_with_the_emulated_recipe_is_refused"],
    ),
    (
        '`recipe = "blockwise"` on CUDA',
        GPU_ONLY,
        "the casts (`fp8/recipes/blockwise/triton_quantizers.py`) equal the torch rules bit for "
        "bit; the GEMMs run on cuBLAS's blockwise `scaled_mm` per token group where the GPU has it "
        "(`fp8/kernels/blockwise_cublas.py`; an H200 with torch 2.11 does), else on our Triton "
        "kernels (`fp8/kernels/blockwise_gemm.py`), equal bit for bit and matching the "
        "emulation: `tests/test_blockwise_cuda.py`, 21 passed on an H200 on 2026-12-04 "
        "(9e664ff). Eager and compiled: torchtitan's MoE layer at Scout 64K tokens 1.24x-1.26x of "
        "bf16; the Scout-width trainer trains eager and compiled, 1.04x of bf16 in one run each "
        "(the data loaded by a worker) ([limitations](limitations.md#speed))",
        [],
    ),
]


def render() -> str:
    lines = [
        "# Compatibility",
        "",
        "Generated from `tests/compatibility.py` (`python tests/compatibility.py > "
        "docs/compatibility.md`);",
        "`tests/test_compatibility_doc.py` checks that this file matches it and that every test "
        "named here exists. CI runs them all on CPU (emulated fp8, gloo).",
        "",
        "| composition | status | what is checked | tests |",
        "|---|---|---|---|",
    ]
    for composition, status, checked, tests in ROWS:
        names = "<br>".join(f"`{t}`" for t in tests) or "-"
        lines.append(f"| {composition} | {status} | {checked} | {names} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
