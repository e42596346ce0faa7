"""Free-text answers by greedy decoding on the hooked model, for tasks scored by a human rubric
(EPITOME's Short Story and Strange Stories).

Why greedy and one prompt at a time: the papers ran GPT-3 at temperature 0, and a human codes each
answer, so the answer must be reproducible: the same model, prompt and settings give the same text.
Decoding re-runs the whole sequence each step (no cache: the hooked model's forward is the one the
rest of tomlens uses, so hooks and patches apply unchanged); answers are short, so this is cheap.
A step reads its token to the host once (whether to stop depends on it) and appends it to the
sequence from the device, so a step waits on the GPU once.
No hub model and no judge model is involved.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.errors import TomlensError
from tomlens.messages import warn
from tomlens.models.protocol import Model
from tomlens.models.tokens import encode
from tomlens.timing import format_seconds, time_call

# Stop at the first line break: every prompt asks for a one-line answer ("Answer:").
STOP_AT = "\n"


# Stop reasons that mean the answer was cut short rather than finished (`cut_off` in the table).
CUT_OFF_REASONS: frozenset[str] = frozenset({"max_new_tokens", "context"})


def _forward_seconds(model: Model, prompt: str) -> float:
    """Seconds of one forward over `prompt` (timed after a warm-up, GPU synchronised), to say
    beforehand how long decoding will take; an upper bound per step, since answers add few tokens."""
    ids = encode(model, [prompt]).input_ids
    return time_call(lambda: model(ids))


def allowed_codes(max_score: int) -> str:
    """The codes a coder may give an item: every integer from 0 to its highest score, as
    `tomlens.behaviour.epitome.import_codes` accepts them ("0, 1, 2")."""
    return ", ".join(str(k) for k in range(int(max_score) + 1))


def _stop_ids(tokenizer: Any) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _prompt_tokens(model: Model, prompt: str) -> int:
    """The prompt's length in tokens, or a number past any window when `encode` refuses it as too long."""
    try:
        return int(encode(model, [prompt]).input_ids.shape[1])
    except TomlensError:
        return 1 << 62


def greedy_continuation(model: Model, prompt: str, *, max_new_tokens: int = 48,
                        stop: str | None = STOP_AT) -> tuple[str, Int[Tensor, " new"]]:
    """The greedy continuation of `prompt` (argmax token each step) until EOS, `stop` in the text
    or `max_new_tokens`; returns (text, token ids). The text is decoded from the new tokens."""
    text, toks, _ = greedy_with_reason(model, prompt, max_new_tokens=max_new_tokens, stop=stop)
    return text, toks


def greedy_with_reason(model: Model, prompt: str, *, max_new_tokens: int = 48,
                       stop: str | None = STOP_AT) -> tuple[str, Int[Tensor, " new"], str]:
    """`greedy_continuation` plus why it stopped: "eos", "stop", "max_new_tokens" or "context" (the
    context window filled mid-answer: the answer is cut short). A prompt that already fills the
    window is a TomlensError, never a silent empty answer."""
    if max_new_tokens < 1:
        raise TomlensError(f"max_new_tokens = {max_new_tokens} must be at least 1", "use e.g. 48")
    batch = encode(model, [prompt])
    ids = batch.input_ids
    n_ctx = getattr(getattr(model, "cfg", None), "n_ctx", None)
    if n_ctx is not None and ids.shape[1] >= n_ctx:
        raise TomlensError(f"the prompt is {ids.shape[1]} tokens and fills the model's context window "
                           f"({n_ctx}); no answer can be generated",
                           "use a model with a longer context or a shorter prompt")
    stops = _stop_ids(model.tokenizer)
    new: list[int] = []
    reason = "max_new_tokens"
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            if n_ctx is not None and ids.shape[1] >= n_ctx:
                reason = "context"
                break
            kwargs: dict[str, Tensor] = {"attention_mask": torch.ones_like(ids)}
            if batch.pass_position_ids:
                kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device)[None, :]
            logits = model(ids, **kwargs)
            picked = logits[:, -1].float().argmax(-1, keepdim=True).to(ids.dtype)  # [1, 1], on the device
            nxt = int(picked)  # the one host read a step needs: whether to stop depends on the token
            if nxt in stops:
                reason = "eos"
                break
            new.append(nxt)
            ids = torch.cat([ids, picked], dim=1)  # the token is already on the device: no copy back
            if stop is not None and stop in model.tokenizer.decode(new).lstrip():
                reason = "stop"
                break
    text = model.tokenizer.decode(new)
    if stop is not None and stop in text.lstrip():
        head = text.lstrip()
        text = head[: head.index(stop)]
    return text.strip(), torch.tensor(new, dtype=torch.long), reason


def generate_answers(model: Model, items: Sequence[Any], *, max_new_tokens: int = 48, seed: int = 0,
                     progress: bool = True) -> pd.DataFrame:
    """One row per free-text item (`tomlens.stimuli.epitome.FreeTextItem`): its labels, rubric,
    the model's greedy answer, `stop_reason`, `cut_off` (decoding stopped at `max_new_tokens` or at
    the context window, not at the answer's end: a coder must know the answer may be incomplete)
    and `cut_by_context` (the window filled mid-answer). Says beforehand roughly how long it will
    take (one timed forward of the longest prompt). A prompt that fills the window raises, before any
    decoding. `seed` seeds torch first (greedy decoding uses no randomness; the seed is recorded so
    that a sampled variant would be reproducible too)."""
    items = list(items)
    if not items:
        raise TomlensError("no free-text items to answer", "pass short_story_items() or strange_stories_items()")
    n_ctx = getattr(getattr(model, "cfg", None), "n_ctx", None)
    if n_ctx is not None:  # checked before any decoding, so no answer is computed and then lost
        long = [it.id for it in items if _prompt_tokens(model, it.prompt) >= n_ctx]
        if long:
            raise TomlensError(f"{len(long)} prompts fill the model's context window of {n_ctx} tokens "
                               f"(first {long[0]!r}); their answers would be empty",
                               "use a model with a longer context, or leave those items out")
    torch.manual_seed(int(seed))
    per_forward = _forward_seconds(model, max(items, key=lambda it: len(it.prompt)).prompt)
    # the estimate goes to stderr (through tqdm: the progress bar below stays intact); stdout is the command's results
    warn(f"generating {len(items)} answers of at most {max_new_tokens} tokens "
               f"(one forward per token; at most {len(items) * max_new_tokens} forwards, "
               f"roughly {format_seconds(per_forward * len(items) * max_new_tokens)} at most)")
    rows = []
    t0 = time.time()
    for item in tqdm(items, desc="generating", unit="answer", disable=not progress):
        text, toks, reason = greedy_with_reason(model, item.prompt, max_new_tokens=max_new_tokens)
        rows.append({"id": item.id, "family": item.family, "story_id": item.story_id,
                     "kind": item.meta.get("kind", ""), "question_type": item.question_type,
                     "question": item.question, "answer": text, "n_new_tokens": int(toks.numel()),
                     "stop_reason": reason, "cut_off": reason in CUT_OFF_REASONS,
                     "cut_by_context": reason == "context",
                     "rubric": item.rubric_text(), "max_score": item.max_score,
                     "allowed": allowed_codes(item.max_score),
                     "decoding": "greedy", "max_new_tokens": max_new_tokens, "seed": int(seed)})
    out = pd.DataFrame(rows)
    out.attrs["seconds"] = round(time.time() - t0, 2)
    return out
