"""`model.generate`'s arguments, as selfspec takes them: merged, checked, and turned into processors.

The generation config is merged exactly as `model.generate` merges it (user arguments over the model's
generation config over transformers' global defaults), and the logits processors are the ones
`model.generate` would build, so p and q are processed exactly like the target's own sampling.
Anything the speculative loop cannot honour raises `UnsupportedGenerationArgument`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

# processors that read each row's scores alone, never the input ids and never in place (exactly these classes, not
# subclasses): a list of them processes every position of a pass in one call instead of one call per position
ROW_WISE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


class UnsupportedGenerationArgument(ValueError):
    """A `generate` argument that selfspec does not support (it is never silently ignored)."""


# generation-config fields that change what `generate` does and that the speculative loop does not do,
# with the value that means "off" (after the global defaults are merged).
_OFF_VALUES: dict[str, tuple] = {
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "num_return_sequences": (None, 1),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "diversity_penalty": (None, 0.0),
    "constraints": (None,),
    "force_words_ids": (None,),
    "guidance_scale": (None, 1, 1.0),
    "watermarking_config": (None,),
    "assistant_early_exit": (None,),
    "prompt_lookup_num_tokens": (None,),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "use_cache": (None, True),
    "cache_implementation": (None, "dynamic"),
    "token_healing": (None, False),
    "prefill_chunk_size": (None,),
    "use_mtp": (None, False),
}

# `generate` keyword arguments outside the generation config that selfspec takes
_CALL_ARGUMENTS = {
    "attention_mask",
    "logits_processor",
    "stopping_criteria",
    "streamer",
    "tokenizer",
    "prefix_allowed_tokens_fn",
}
# `generate` keyword arguments that select machinery selfspec replaces or does not have
_REJECTED_CALL_ARGUMENTS = {
    "assistant_model": "selfspec drafts with the model's own layers; an assistant model is not used",
    "synced_gpus": "synchronised multi-GPU generation is not supported",
    "negative_prompt_ids": "classifier-free guidance is not supported",
    "negative_prompt_attention_mask": "classifier-free guidance is not supported",
    "custom_generate": "custom generation loops are not supported",
    "past_key_values": "selfspec manages its own cache; pass the prompt instead",
    "cache": "selfspec manages its own cache; pass the prompt instead",
    "inputs_embeds": "selfspec needs token ids; pass `input_ids`",
}


@dataclass
class GenerationSetup:
    """Everything one `generate` call needs, resolved once before the loop."""

    config: GenerationConfig
    do_sample: bool
    max_new_tokens: int
    eos_token_ids: frozenset[int]  # empty when there is none
    pad_token_id: int | None
    processors: LogitsProcessorList
    row_processors: list[LogitsProcessorList]  # batches: one list per row, built for that row alone
    stopping_criteria: StoppingCriteriaList  # user criteria, stop strings and max_time (length and EOS are built in)
    attention_mask: torch.Tensor | None
    streamer: object | None


def prepare_generation(
    model, input_ids: torch.Tensor, generation_config: GenerationConfig | None, kwargs: dict
) -> GenerationSetup:
    """Merge and check `generate`'s arguments for `model` (the unwrapped transformers model)."""
    for name, why in _REJECTED_CALL_ARGUMENTS.items():
        if kwargs.get(name) is not None and not (name == "synced_gpus" and kwargs[name] is False):  # False: off
            raise UnsupportedGenerationArgument(f"`{name}` is not supported by selfspec: {why}.")
        kwargs.pop(name, None)
    call = {name: kwargs.pop(name) for name in list(kwargs) if name in _CALL_ARGUMENTS}
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    config, unused = model._prepare_generation_config(generation_config, **kwargs)
    unused = {name: value for name, value in unused.items() if value is not None}
    if unused:
        raise UnsupportedGenerationArgument(
            f"Unsupported `generate` argument(s): {', '.join(sorted(unused))}. selfspec takes the generation-config "
            f"fields and {', '.join(sorted(_CALL_ARGUMENTS))}."
        )
    for field, off in _OFF_VALUES.items():
        value = getattr(config, field, None)
        if value not in off:
            raise UnsupportedGenerationArgument(f"`{field}={value!r}` is not supported by selfspec.")

    prompt_length = input_ids.shape[1]
    if config.max_new_tokens is not None:
        max_new_tokens = config.max_new_tokens
    else:
        max_length = config.max_length + (prompt_length if has_default_max_length else 0)
        positions = getattr(model.config, "max_position_embeddings", None)
        if has_default_max_length and positions is not None:  # as generate: the default stops at the model's end
            max_length = min(max_length, positions)
        max_new_tokens = max_length - prompt_length
    if max_new_tokens < 1:
        raise ValueError(
            f"Nothing to generate: the prompt has {prompt_length} tokens and max_length leaves "
            f"{max_new_tokens} new tokens; "
            "set max_new_tokens."
        )

    attention_mask = call.get("attention_mask")
    model._prepare_special_tokens(config, attention_mask is not None, device=input_ids.device)
    config.max_length = prompt_length + max_new_tokens  # what processors such as forced_eos read
    if attention_mask is None:  # as generate: the pad tokens in the prompts are masked (unless pad is EOS)
        inferred = model._prepare_attention_mask_for_generation(input_ids, config, {})
        if not bool(inferred.all()):
            if bool((inferred[:, :-1] > inferred[:, 1:]).any()):
                raise ValueError(
                    f"A prompt holds the pad token {int(config._pad_token_tensor)} after its text, and no "
                    "attention_mask was given: model.generate would mask it there, and selfspec supports left "
                    "padding only. Pass the attention_mask the tokenizer returned, or remove the pad tokens."
                )
            attention_mask = inferred
    check_stopping_criteria(call.get("stopping_criteria"), config)

    allowed = call.get("prefix_allowed_tokens_fn")

    def build_processors(rows: slice) -> LogitsProcessorList:
        row_allowed = allowed
        if allowed is not None and rows.start:  # a row's own list: the function still sees the row's batch index
            row_allowed = partial(shifted_batch_id, allowed, rows.start)
        return model._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=prompt_length,
            encoder_input_ids=input_ids[rows],
            prefix_allowed_tokens_fn=row_allowed,
            logits_processor=call.get("logits_processor") or LogitsProcessorList(),
            device=input_ids.device,
            model_kwargs={"attention_mask": attention_mask[rows] if attention_mask is not None else None},
        )

    processors = build_processors(slice(None))
    # once rows of a batch have gained different numbers of tokens, each is processed on its own; some
    # processors hold per-row state (the prompt padding of each row), so each row gets its own list
    batch = input_ids.shape[0]
    row_processors = [build_processors(slice(b, b + 1)) for b in range(batch)] if batch > 1 and processors else []
    criteria = StoppingCriteriaList(call.get("stopping_criteria") or [])
    if config.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=config.max_time))
    if config.stop_strings is not None:
        if call.get("tokenizer") is None:
            raise ValueError("Stop strings need the tokenizer: pass `tokenizer=` to generate.")
        criteria.append(StopStringCriteria(stop_strings=config.stop_strings, tokenizer=call["tokenizer"]))
    eos = config._eos_token_tensor
    pad = config._pad_token_tensor
    return GenerationSetup(
        config=config,
        do_sample=bool(config.do_sample),
        max_new_tokens=max_new_tokens,
        eos_token_ids=frozenset() if eos is None else frozenset(eos.reshape(-1).tolist()),
        pad_token_id=None if pad is None else int(pad),
        processors=processors,
        row_processors=row_processors,
        stopping_criteria=criteria,
        attention_mask=attention_mask,
        streamer=call.get("streamer"),
    )


def check_stopping_criteria(criteria, config: GenerationConfig) -> None:
    """Refuse the stopping criteria that `model.generate` would put in place of its own (the same types): a
    length criterion always, an end-of-sequence one where the config has an end-of-sequence token."""
    for criterion in criteria or []:
        if isinstance(criterion, MaxLengthCriteria):
            raise UnsupportedGenerationArgument(
                "A MaxLengthCriteria in stopping_criteria would replace generate's own length limit: pass "
                "max_new_tokens= or max_length= instead."
            )
        if isinstance(criterion, EosTokenCriteria) and config._eos_token_tensor is not None:
            raise UnsupportedGenerationArgument(
                "An EosTokenCriteria in stopping_criteria would replace generate's own end-of-sequence criterion "
                "(the config's eos_token_id): pass eos_token_id= instead."
            )


def pads_stopped_rows(setup: GenerationSetup) -> bool:
    """Whether `model.generate` pads a row once it stops: where there is an end-of-sequence token, or a stopping
    criterion that declares one (`eos_token_id`); else a stopped row goes on until every row has stopped."""
    return bool(setup.eos_token_ids) or any(hasattr(c, "eos_token_id") for c in setup.stopping_criteria)


def shifted_batch_id(allowed, first: int, batch_id: int, input_ids: torch.Tensor):
    """`prefix_allowed_tokens_fn` for the processors of rows first, first + 1 ...: called with the batch index
    `model.generate` would pass (first + batch_id), not the index within those rows."""
    return allowed(first + batch_id, input_ids)


def row_wise(processors: LogitsProcessorList) -> bool:
    """Whether every processor in the list is one of `ROW_WISE_PROCESSORS`."""
    return all(type(processor) in ROW_WISE_PROCESSORS for processor in processors)


def process_scores(
    processors: LogitsProcessorList | list[LogitsProcessorList],
    prefix: torch.Tensor | list[torch.Tensor],
    tokens: torch.Tensor,
    logits: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """Processed scores for consecutive positions.

    prefix: [batch, T] committed tokens, or one [1, T_b] tensor per row when rows differ in length
    (then `processors` is one list per row);
    tokens: [batch, G] drafted tokens that follow the prefix; logits: [batch, P, V] raw logits, position
    i coming after prefix + tokens[:, :offset + i]. Returns float32 scores [batch, P, V], each position
    processed with its own input ids, as `model.generate` would process it (when no processor reads input ids,
    all positions at once).
    """
    logits = logits.float()
    if len(processors) == 0:
        return logits
    first = processors if isinstance(prefix, torch.Tensor) else processors[0]  # the rows' lists hold the same kinds
    if row_wise(first):
        return first(tokens, logits.reshape(-1, logits.shape[-1])).reshape(logits.shape)
    if isinstance(prefix, torch.Tensor):
        rows, slices, lists = [prefix], [slice(None)], [processors]
    else:
        rows, slices, lists = prefix, [slice(b, b + 1) for b in range(len(prefix))], processors
    positions = []
    for i in range(logits.shape[1]):
        per_row = [
            row_processors(torch.cat([row, tokens[part, : offset + i]], dim=1), logits[part, i].clone())
            for row, part, row_processors in zip(rows, slices, lists, strict=True)
        ]
        positions.append(torch.cat(per_row, dim=0))
    return torch.stack(positions, dim=1)


class TreeScores:
    """The target's processed scores at the nodes of one prompt's candidate tree (trees verify one prompt at a
    time), as a walk asks for them: called with node [1] long, it returns float32 [1, V], the scores at that
    node processed with its own input ids (the prefix, then the candidate tokens on the node's path), as
    `model.generate` would process them.

    A node's scores are processed when asked, so the processors meet only the prefixes a walk reaches: the
    candidates the target takes, up to an end of sequence and within the token budget, as in plain decoding (a
    `prefix_allowed_tokens_fn` that allows nothing after a candidate the target never takes, or after the end of
    sequence, is never asked there); and a tree of 16 nodes pays for the two or three a walk reaches.

    prefix: [1, T]; node_tokens: [1, N]; logits: [1, N+1, V] (node 0 is the root).
    """

    def __init__(self, processors: LogitsProcessorList, prefix: torch.Tensor, node_tokens, logits, tree):
        self.processors, self.prefix, self.node_tokens, self.logits, self.tree = (
            processors, prefix, node_tokens, logits, tree,
        )  # fmt: skip
        self.rows = torch.arange(logits.shape[0], device=logits.device)

    def __call__(self, node: torch.Tensor) -> torch.Tensor:
        raw = self.logits[self.rows, node].float()  # [1, V], a copy: processors may write into it
        if len(self.processors) == 0:
            return raw
        if row_wise(self.processors):
            return self.processors(self.node_tokens, raw)
        (index,) = node.tolist()
        path = self.node_tokens[:, [n - 1 for n in self.tree.prefixes[index]]]
        return self.processors(torch.cat([self.prefix, path], dim=1), raw)


def stopping_point(setup: GenerationSetup, prefix: torch.Tensor, new: torch.Tensor, scores: torch.Tensor) -> int | None:
    """How many of the tokens `new` [n] appended to one row's `prefix` [1, length] (without added padding) to
    keep when a stopping criterion fires among them, else None. scores: [>= n, V] the processed scores each
    of those tokens was drawn from. Only called when the setup has stopping criteria."""
    flags = [
        setup.stopping_criteria(torch.cat([prefix, new[None, : j + 1]], dim=1), scores[j : j + 1]).reshape(-1).any()
        for j in range(new.shape[0])
    ]
    hits = torch.stack(flags).tolist()
    return hits.index(True) + 1 if True in hits else None


def generate_output(rows: list[torch.Tensor], pad_token_id: int, config: GenerationConfig, scores: list, logits: list):
    """What `model.generate` returns: the rows (1-D, as the caller gave them plus what they generated), those
    that finished early padded on the right with the pad token; a `GenerateDecoderOnlyOutput` when asked."""
    length = max(row.shape[0] for row in rows)
    sequences = torch.stack(
        [torch.nn.functional.pad(row, (0, length - row.shape[0]), value=pad_token_id) for row in rows]
    )
    if not config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(scores) if config.output_scores else None,
        logits=tuple(logits) if config.output_logits else None,
    )
