"""Adapters: DeepSeek-V4.1 vision under prefill context parallelism at runtime.

- ``around_deepseek_v4_init``: lets ``DeepseekV4ForCausalLM.__init__`` build the
  vision tower when attention CP > 1, for CUDA + interleave only (patch VCP-BUILD).
- ``execute_extend_cp``: the eager CP runner with the model's input preparation
  (image merge, placeholder-id remap) moved before the shard (patch VCP-RUNNER).
- ``prepare_model_inputs``: the name that runner calls on the model (patch VCP-PREPARE).
"""

from __future__ import annotations

from sglang_dsv41.vision_cp.runtime import (
    CPGuardLift,
    VisionCPBuildRefused,
    builds_vision_tower,
    check_vision_cp_platform,
)

# The constructor's own refusal for vision with CP, PP or an unsupported MoE A2A.
_UPSTREAM_VISION_REFUSAL = "V4.1 vision supports"


def _check_platform(model_module) -> None:
    from sglang.srt.layers.cp.base import get_cp_strategy_kind

    check_vision_cp_platform(
        attn_cp_size=model_module.get_parallel().attn_cp_size,
        is_cuda=bool(model_module._is_cuda),
        is_npu=bool(model_module._is_npu),
        strategy=get_cp_strategy_kind().name.lower(),
    )


def around_deepseek_v4_init(original, self, config, *args, **kwargs):
    """AROUND DeepseekV4ForCausalLM.__init__.

    Without vision or without CP this is the stock constructor. With both, the
    constructor runs with its CP guard seeing one CP rank; its PP and MoE A2A
    checks still apply, the platform/strategy check of this package runs right
    before the vision tower is built, and the tower itself sees the real CP.
    """
    from sglang.srt.models import deepseek_v4 as model_module

    if not builds_vision_tower(config) or model_module.get_parallel().attn_cp_size == 1:
        return original(self, config, *args, **kwargs)

    lift = CPGuardLift(model_module, tower_name="ViT",
                       check=lambda: _check_platform(model_module))
    with lift:
        try:
            result = original(self, config, *args, **kwargs)
        except VisionCPBuildRefused:
            raise
        except ValueError as err:
            if lift.tower_built or _UPSTREAM_VISION_REFUSAL not in str(err):
                raise
            raise ValueError(
                f"{err} [sglang-dsv41: context parallelism itself is supported for "
                "V4.1 vision with CUDA and --cp-strategy interleave; the pipeline "
                "parallel or MoE A2A setting is what is refused]"
            ) from err
    if not lift.tower_built:
        raise RuntimeError(
            "[sglang-dsv41] DeepseekV4ForCausalLM.__init__ finished without building "
            "the V4.1 vision tower while its CP guard was lifted; the constructor no "
            "longer matches the one VCP-BUILD was written for"
        )
    return result


def prepare_model_inputs(self, input_ids, forward_batch, input_embeds=None):
    """NEW on DeepseekV4ForCausalLM: prepare language-model inputs on the full extend
    layout (image merge, placeholder hashes -> image token id).

    Delegates to sglang's ``prepare_language_model_inputs`` so that anything
    wrapping that method (the owner-broadcast fence) also covers the CP runner.
    Returns ``(input_ids, input_embeds)``; the ids passed in are never modified.
    """
    return self.prepare_language_model_inputs(input_ids, forward_batch, input_embeds)


def execute_extend_cp(self, forward_batch, kwargs):
    """REPLACE EagerRunner._execute_extend_cp.

    Same steps as sglang 0.5.23 (shard at the model boundary, run the body on this
    rank's rows, gather before the logits), with one change: a model that has
    ``prepare_model_inputs`` prepares its inputs on the full extend layout first,
    and the ids it returns (not the scheduler's ``forward_batch.input_ids``, which
    hold image placeholder hashes) feed the embedding, the shard, the MoE routing
    ids and the logits. The scheduler's ids are never written.
    """
    from sglang.srt.model_executor.runner import eager_runner as runner_module

    model = self.model_runner.model
    model_ids = forward_batch.input_ids

    if prepare_cp_inputs := getattr(model, "prepare_cp_inputs", None):
        input_embeds, positions, model_kwargs = prepare_cp_inputs(forward_batch, **kwargs)
    else:
        input_embeds = kwargs.get("input_embeds")
        if prepare := getattr(model, "prepare_model_inputs", None):
            model_ids, input_embeds = prepare(
                input_ids=model_ids, forward_batch=forward_batch, input_embeds=input_embeds
            )
        if input_embeds is None:
            input_embeds = model.get_input_embeddings()(model_ids)
        positions = forward_batch.positions
        model_kwargs = {}
        if (pp_proxy_tensors := kwargs.get("pp_proxy_tensors")) is not None:
            model_kwargs["pp_proxy_tensors"] = pp_proxy_tensors

    with runner_module.cp_shard_model_inputs(
        input_embeds, positions, forward_batch, model_ids
    ) as (local_embeds, local_positions, local_ids):
        model_kwargs["input_embeds"] = local_embeds
        hidden_states = model.model(local_ids, local_positions, forward_batch, **model_kwargs)

    capture_aux = getattr(model, "capture_aux_hidden_states", False)
    aux_hidden_states = None
    if capture_aux:
        hidden_states, aux_hidden_states = hidden_states
    if not model.pp_group.is_last_rank:
        return (hidden_states, aux_hidden_states) if capture_aux else hidden_states

    gather = runner_module.cp_gather_after_forward
    stream = runner_module.torch.cuda.current_stream()
    hidden_states = gather(hidden_states, forward_batch, stream)
    if aux_hidden_states is not None:
        # DSpark aux tensors use the same CP row split as the hidden states.
        if isinstance(aux_hidden_states, runner_module.torch.Tensor):
            aux_hidden_states = gather(aux_hidden_states, forward_batch, stream)
        else:
            aux_hidden_states = [gather(a, forward_batch, stream) for a in aux_hidden_states]
    logits_kwargs = {}
    if isinstance(hidden_states, tuple):
        # DSv4 bodies return (hidden_states, hidden_states_before_norm); the pre-norm
        # states would override packed DSpark aux states, so they go only without aux.
        hidden_states, hidden_states_before_norm = hidden_states
        if aux_hidden_states is None:
            logits_kwargs["hidden_states_before_norm"] = hidden_states_before_norm
    return model.logits_processor(
        model_ids,
        hidden_states,
        model.lm_head,
        forward_batch,
        aux_hidden_states,
        **logits_kwargs,
    )
