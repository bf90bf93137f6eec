"""What every kind of draft heads shares: `DraftHeads` (the target's fingerprint, a tuned gamma, an optional
draft-only LoRA, the folder writer, and the methods each kind implements for training, `selfspec profile` and
`selfspec tune`), what those methods exchange (a distillation `Draft`, measured `Costs`, a `DraftSetting`) and the
folder's file names."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..adapter import DraftVocabulary, ModelAdapter, ModelFingerprint
from .lora import DraftLoRA

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"


class HeadsMismatchError(ValueError):
    """Heads trained for another target, or a heads folder that is incomplete or corrupted."""


@dataclass
class DraftSetting:
    """A way of drafting with some heads, which `selfspec tune` measures: chains of gamma = 1..max_gamma drafts,
    and candidate trees up to `tree_depth` levels."""

    name: str  # the drafts it uses: exit_<k>, or medusa (all Medusa heads together)
    label: str  # how tables call its chains: exit <k> | medusa chain
    options: dict  # the SelfSpeculative arguments that select its chains
    max_gamma: int  # the longest chain it drafts
    timed: str  # the draft whose measured time (`Costs.c`) one drafting call takes ...
    per_call: int  # ... and the draft tokens that call gives: c = Costs.c(timed) / per_call
    upper: float  # the share of the layers that a verify pass runs for its extra positions
    tree_depth: int = 0  # the deepest candidate tree it drafts (0: chains only)
    dynamic_trees: tuple[dict, ...] = ()  # EAGLE-2 tree shapes ({nodes, top_k, depth}) to measure


@dataclass
class Draft:
    """One draft of a heads set on one batch, for training: what its head reads and the target logits it must
    match (not the decoding loop's `selfspec.Draft`)."""

    name: str  # exit_<k> or medusa_<i>
    hidden: torch.Tensor  # [batch, positions, H] the head's input
    offset: int  # the teacher of the head's position t is the target's distribution at t + offset
    # hidden -> draft logits [batch, positions, V], or [..., N] over a compacted draft vocabulary's tokens
    head: Callable[[torch.Tensor], torch.Tensor]
    weight: float = 1.0  # its share of the training loss (an EAGLE head weighs later unrolled steps less)

    def teacher(self, per_position: torch.Tensor) -> torch.Tensor:
        """The entries of a per-target-position tensor `[batch, T, ...]` that this draft is taught by."""
        return per_position[:, self.offset : self.offset + self.hidden.shape[1]]


@dataclass
class Costs:
    """Median seconds of one full one-token step, of one draft token per draft, and (if measured) of one
    verify pass over gamma+1 positions."""

    step_s: float
    draft_s: dict[str, float]
    verify_s: dict[int, float] = field(default_factory=dict)

    def c(self, name: str) -> float:
        return self.draft_s[name] / self.step_s

    def v(self, gamma: int) -> float:
        return self.verify_s[gamma] / self.step_s if gamma in self.verify_s else 1.0


class DraftHeads(nn.Module):
    """What every kind of heads shares: the target fingerprint, a default gamma, an optional draft-only LoRA
    on the shared LM head (`selfspec.heads.lora`), the folder format."""

    kind = ""
    setting_names: tuple[str, ...] = ()  # the constructor arguments that `settings` records, each an attribute too

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        num_draft_tokens: int | None = None,
        position_cost: float | None = None,
        draft_lora: dict | None = None,
    ):
        super().__init__()
        self.fingerprint = fingerprint
        self.num_draft_tokens = num_draft_tokens
        self.position_cost = position_cost  # measured by `selfspec tune`: see SelfSpeculative(position_cost=)
        self.draft_lora = (
            DraftLoRA.from_settings(fingerprint.hidden_size, fingerprint.vocab_size, draft_lora) if draft_lora else None
        )

    def settings(self) -> dict:
        """The constructor arguments (besides the fingerprint) that rebuild these heads: `setting_names`."""
        if not self.setting_names:
            raise self._missing("settings")
        return {name: getattr(self, name) for name in self.setting_names}

    # What training (selfspec.training.distill), `selfspec profile` and `selfspec tune` need of a kind: each kind
    # implements these, so that none of them asks which kind it holds. (Its drafter is `selfspec.drafters`'.)

    @classmethod
    def from_config(cls, config, adapter: ModelAdapter) -> DraftHeads:
        """Untrained heads as the `heads` section of a training config (`selfspec.training.config.HeadsConfig`)
        describes them, for `adapter`'s target."""
        raise NotImplementedError(f"heads of kind {cls.kind!r} ({cls.__name__}) do not implement from_config")

    def start_from(self, start: DraftHeads) -> None:
        """Take the trained weights of `start`, heads of this kind (`heads.init_from`): the same shape, else
        RuntimeError (or HeadsMismatchError, where a kind accepts some other shapes)."""
        self.load_state_dict(self.start_state(start))

    def start_state(self, start: DraftHeads) -> dict[str, torch.Tensor]:
        """`start`'s weights for these heads: with its draft LoRA where both have one; where only these heads have
        one, theirs stays as built (a fresh adapter on trained heads); a start with a LoRA these heads lack is
        refused (HeadsMismatchError), since dropping it would change what the start drafts."""
        state = start.state_dict()
        if start.draft_lora is not None and self.draft_lora is None:
            raise HeadsMismatchError(
                f"the start has a draft LoRA (r={start.draft_lora.r}) and these heads none: set lora.r (and alpha) "
                "as the start's config.json gives them to train it on, or start from heads without one"
            )
        if start.draft_lora is not None and self.draft_lora is not None:
            # alpha and rslora are no weights: load_state_dict would take the factors under another scaling
            keys = ("r", "lora_alpha", "use_rslora")
            theirs, mine = start.draft_lora.settings(), self.draft_lora.settings()
            if any(theirs[k] != mine[k] for k in keys):
                raise HeadsMismatchError(
                    f"the start's draft LoRA has {', '.join(f'{k}={theirs[k]}' for k in keys)}, these heads' "
                    f"{', '.join(f'{k}={mine[k]}' for k in keys)}: set lora.r, lora.alpha and lora.rslora as the "
                    "start's config.json gives them"
                )
        if self.draft_lora is not None and start.draft_lora is None:
            state.update({f"draft_lora.{name}": t for name, t in self.draft_lora.state_dict().items()})
        return state

    def draft_names(self) -> list[str]:
        """One name per draft, `<kind>_<depth>`, in order: evaluations, tables and `Costs` are keyed by them."""
        raise self._missing("draft_names")

    def distillation_drafts(
        self, adapter: ModelAdapter, hidden_states, vocab: DraftVocabulary | None = None, learn=None
    ) -> list[Draft]:
        """The drafts and their teachers given one target forward's `hidden_states` (as `output_hidden_states=True`
        returns them: L+1 entries `[batch, T, H]`, the last one normed), through the LM head as `vocab` gives it
        (a reduced or int8 draft head; None: the model's own). With `learn` ([batch, T] bool: the target
        positions whose distributions are read, training's loss mask), a draft's input is exact where its teacher
        is marked and may be any finite value elsewhere (heads may skip that work)."""
        raise self._missing("distillation_drafts")

    def hidden_entries(self) -> tuple[int, ...]:
        """The entries of `hidden_states` (0..L, L the last, normed) that `distillation_drafts` reads: what a
        feature cache (`selfspec.training.feature_cache`) must keep for these heads."""
        raise self._missing("hidden_entries")

    def untrained_copy(self) -> DraftHeads:
        """Fresh heads with the same drafts, on the same device and dtype: what the target drafts untrained."""
        raise self._missing("untrained_copy")

    def cost_timers(
        self, adapter: ModelAdapter, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, vocab
    ) -> dict[str, tuple[Callable[[object], object], list[str]]]:
        """What `selfspec.measure.costs.measure_costs` times for c: {label: (call(cache), the drafts its time is
        charged to)}. A call drafts after the cached context: `ids`, `positions` [1, 1] are the next token, `hidden`
        [1, n, H] the context's normed last hidden states; `vocab` is the draft LM head (None: the model's own)."""
        raise self._missing("cost_timers")

    def speedups(self, alphas: dict[str, float], costs: Costs, max_gamma: int) -> dict[str, dict]:
        """Per draft: c, the best gamma and its predicted speedup, from the drafts' alphas and measured `costs`."""
        raise self._missing("speedups")

    def draft_settings(self, num_layers: int, max_gamma: int) -> list[DraftSetting]:
        """The ways of drafting with these heads that `selfspec tune` measures (chains up to `max_gamma` where
        the kind has no longer limit of its own) on a target of `num_layers` layers."""
        raise self._missing("draft_settings")

    def set_defaults(self, options: dict) -> None:
        """Make a tuned choice's `SelfSpeculative` options these heads' defaults (their folder records them)."""
        raise self._missing("set_defaults")

    def description(self) -> str:
        """What these heads are, for their card: "exit heads (one per exit depth)", "4 Medusa heads"."""
        raise self._missing("description")

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"heads of kind {self.kind!r} ({type(self).__name__}) do not implement {method}")

    def _as_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` on the heads' device and dtype (heads may train in float32 on a half-precision target)."""
        weight = next(self.parameters())
        return hidden.to(device=weight.device, dtype=weight.dtype)

    def _alike(self, fresh: DraftHeads) -> DraftHeads:
        weight = next(self.parameters())
        return fresh.to(device=weight.device, dtype=weight.dtype)

    def config_dict(self) -> dict:
        lora = self.draft_lora.settings() if self.draft_lora is not None else None
        settings = {**self.settings(), "position_cost": self.position_cost, "draft_lora": lora}
        return {"kind": self.kind, **settings, "target": self.fingerprint.to_dict()}

    def save_pretrained(
        self, path: str | os.PathLike, card: str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """Write config, weights and card atomically: a crash leaves the old folder or the new one. `dtype`: the
        floating-point weights' dtype in the file (default: as they are); loading casts them to the heads' own.
        Other files in an existing folder (notes, evaluations) stay; a folder whose config.json is a model's is
        refused (FileExistsError): it would lose the model's config and weights."""
        state = {name: tensor.detach() for name, tensor in self.state_dict().items()}
        if dtype is not None:
            state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
        card = card or f"# selfspec {self.kind} heads\n\nTarget: {self.fingerprint.name_or_path}\n"
        path = Path(path)
        check_not_a_model(path)
        write_folder(path, self.config_dict(), state, card, {"format": "pt", "kind": self.kind}, keep_others=True)

    def save_defaults(self, path: str | os.PathLike, card: str | None = None) -> None:
        """Write the heads' settings into config.json of the heads folder at `path` (its other keys kept), and the
        card when given, each file replaced atomically: the weights and every other file stay as they are (what
        `selfspec tune` changes)."""
        path = Path(path)
        config_path = path / CONFIG_NAME
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        replace_file(config_path, json.dumps({**config, **self.config_dict()}, indent=2) + "\n")
        if card is not None:
            replace_file(path / CARD_NAME, card)


def replace_file(path: Path, text: str) -> None:
    """Write `text` into `path` through a file beside it, renamed over it: a crash leaves the old file or the new."""
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()  # mkstemp makes it 0600
        os.chmod(staging, mode)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def check_not_a_model(path: Path) -> None:
    """Raise FileExistsError where `path` holds a config.json that is not a heads folder's (a model's): writing heads
    there would replace the model's config and weights."""
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        return
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict) or "kind" not in config:
        raise FileExistsError(
            f"{path} holds a {CONFIG_NAME} that is not a heads folder's (a model's?): saving heads there would replace "
            "it and the weights beside it. Save the heads in a folder of their own."
        )


def write_folder(
    path: Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    card: str,
    metadata: dict,
    keep_others: bool = False,
) -> None:
    """config.json, model.safetensors (with `metadata`) and README.md, written atomically (`staged_folder`; with
    `keep_others`, the existing folder's other files stay)."""
    with staged_folder(path, keep_others) as staging:
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        save_file({n: t.contiguous().cpu() for n, t in tensors.items()}, staging / WEIGHTS_NAME, metadata=metadata)
        (staging / WEIGHTS_NAME).chmod(0o666 & ~_umask())  # safetensors writes it private (0600)
        (staging / CARD_NAME).write_text(card)


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else the nearest folder above it that does (the root always exists): what decides
    whether a folder can be made there (a file in the way, a folder this user cannot write)."""
    return next(p for p in (path, *path.absolute().parents) if p.exists())


@contextmanager
def staged_folder(path: Path, keep_others: bool = False) -> Iterator[Path]:
    """A staging folder beside `path` to write into, renamed to `path` when the block ends without an error (removed
    when it raises): a crash leaves the old folder or the new one (killed between the two renames that replace an
    existing folder, the old one in a hidden `.NAME.old.*` folder beside it). With `keep_others`, the entries of an
    existing folder at `path` that the block did not write are carried over (hard-linked, or copied), not deleted."""
    path = Path(os.path.abspath(path))  # "." or "out/..": its own name, staged beside it (".".parent is "." itself)
    cwd, real = Path.cwd(), Path(os.path.realpath(path))  # getcwd() is real: compare real paths (symlinked parents)
    if real == cwd or real in cwd.parents:
        raise ValueError(
            f"{path} is the current folder or holds it: it cannot be replaced while in use; name a folder inside it"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private (0700); a heads folder is made like any other
    try:
        yield staging
        if keep_others and path.is_dir():
            _carry_over(path, staging)
    except BaseException:
        shutil.rmtree(staging)
        raise
    if path.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
        os.replace(path, retired / path.name)
        os.replace(staging, path)
        shutil.rmtree(retired)
    else:
        os.replace(staging, path)


def _carry_over(old: Path, new: Path) -> None:
    """The entries of folder `old` that `new` lacks, into `new`: files hard-linked (copied where the file system
    cannot link), folders copied that way, links as links."""

    def link_or_copy(source, target):
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    for entry in old.iterdir():
        target = new / entry.name
        if target.exists() or target.is_symlink():
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), target)
        elif entry.is_dir():
            shutil.copytree(entry, target, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(entry, target)


def on_target(hidden: torch.Tensor, adapter: ModelAdapter) -> torch.Tensor:
    """A head's output on the target's device and dtype, for the target's own norm and LM head."""
    return hidden.to(device=adapter.device, dtype=adapter.dtype)


def _umask() -> int:
    """This process's umask (read by setting it, and set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
