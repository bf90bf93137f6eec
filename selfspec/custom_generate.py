"""selfspec inside `model.generate`: `model.generate(**inputs, custom_generate=spec)` (and pipelines that call it).

transformers prepares the call (the merged generation config, the logits processors and stopping criteria, the
attention mask) and hands its decoding loop over to the callable. `run_custom_generate` gives the loop back the
arguments the caller gave: what generate built from the config it builds again, so the caller's own processors and
criteria are what remains, and `spec.generate` then processes every position exactly as `model.generate` would.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

from .bundle import is_bundle

# model keyword arguments generate prepares for its own loop, which selfspec's loop makes itself
PREPARED_BY_GENERATE = ("cache", "past_key_values", "position_ids", "use_cache", "logits_to_keep", "cache_position")


class _PromptPutAlready:
    """A streamer whose first `put` (the prompt, which generate streamed before handing over) is dropped."""

    def __init__(self, streamer):
        self.streamer, self.prompt_seen = streamer, False

    def put(self, value):
        if self.prompt_seen:
            self.streamer.put(value)
        self.prompt_seen = True

    def end(self):
        self.streamer.end()


def _same(a, b) -> bool:
    """Whether two processors (or criteria) of one type hold the same settings."""
    if type(a) is not type(b) or vars(a).keys() != vars(b).keys():
        return False
    for key, value in vars(a).items():
        other = vars(b)[key]
        if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and torch.equal(value, other)):
                return False
        else:
            try:
                if value != other:
                    return False
            except Exception:  # values without a plain equality (callables compare by identity and do not raise)
                return False
    return True


def callers_own(prepared, built) -> list:
    """The entries of `prepared` (generate's merged list) that the caller gave: generate puts its own first, each
    replaced by a caller's of the same type, then the caller's others."""
    own = [entry for entry, default in zip(prepared, built, strict=False) if not _same(entry, default)]
    return own + list(prepared)[len(built) :]


def run_custom_generate(
    spec, model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, tokenizer, model_kwargs
):
    """The body of `SelfSpeculative.__call__`: `spec.generate` with the arguments model.generate was given."""
    if model is not spec.model and model is not spec.adapter.model:
        raise ValueError(
            f"custom_generate={spec!r} wraps another model than the {type(model).__name__} whose generate was called: "
            "pass the wrapper of this model."
        )
    attention_mask = model_kwargs.pop("attention_mask", None)
    for name in PREPARED_BY_GENERATE:
        model_kwargs.pop(name, None)
    base = spec.adapter.model
    processors = base._get_logits_processor(
        generation_config=generation_config,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=input_ids.device,
        model_kwargs={"attention_mask": attention_mask},
    )
    own_processors = callers_own(logits_processor, processors)
    allowed = [p for p in own_processors if isinstance(p, PrefixConstrainedLogitsProcessor)]
    own_processors = [p for p in own_processors if not isinstance(p, PrefixConstrainedLogitsProcessor)]
    criteria = base._get_stopping_criteria(generation_config, StoppingCriteriaList(), tokenizer=tokenizer)
    return spec.generate(
        input_ids,
        generation_config=generation_config,
        attention_mask=attention_mask,
        logits_processor=LogitsProcessorList(own_processors),
        stopping_criteria=StoppingCriteriaList(callers_own(stopping_criteria, criteria)),
        prefix_allowed_tokens_fn=allowed[0]._prefix_allowed_tokens_fn if allowed else None,
        streamer=_PromptPutAlready(streamer) if streamer is not None else None,
        tokenizer=tokenizer,
        **model_kwargs,
    )


_WRAPPERS: dict = {}  # (id of the model, bundle folder) -> (the model, its SelfSpeculative), for bundle_generate


def bundle_generate(model, name: str, bundle=None, **generate_arguments):
    """A bundle's `custom_generate/generate.py` (`model.generate(custom_generate=FOLDER, trust_remote_code=True)`):
    `SelfSpeculative(model, heads=bundle).generate(...)`, one wrapper per model and bundle. transformers runs a copy
    of that file, not the folder, so the folder is `bundle=` where given, else the bundle `name` that selfspec ships
    (`heads/<name>` in a clone of the repository)."""
    from .speculative import SelfSpeculative
    from .targets import HEADS_ROOT

    folder = Path(bundle) if bundle is not None else HEADS_ROOT / name
    if not is_bundle(folder):
        raise FileNotFoundError(
            f"No selfspec bundle at {folder}: pass the bundle's folder to generate as bundle=FOLDER (transformers runs "
            "a copy of its custom_generate/generate.py, which cannot see the folder it came from)."
        )
    key = (id(model), str(folder.resolve()))
    if key not in _WRAPPERS or _WRAPPERS[key][0] is not model:
        _WRAPPERS[key] = (model, SelfSpeculative(model, heads=folder))
    spec = _WRAPPERS[key][1]
    for name_given in ("custom_generate", "trust_remote_code"):
        generate_arguments.pop(name_given, None)
    return spec.generate(**{key: value for key, value in generate_arguments.items() if value is not None})
