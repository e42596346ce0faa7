"""Minimal pairs made ready for patching: tokenised once for a model, checked to be aligned, sorted
by length into groups of pairs (little padding), with the answer tokens of the metric and the
padded column of every selector position.

In a group's batch, rows `0..g-1` are the clean stories and `g..2g-1` the corrupted ones; `roles`
says which row a patched run is based on and which one its patched values come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.models.protocol import Model
from tomlens.models.tokens import option_first_tokens

Direction = Literal["denoise", "noise"]


@dataclass
class Group:
    """A batch of pairs: rows `0..g-1` are the clean stories, `g..2g-1` the corrupted ones.

    Everything a sweep plans with is also kept as plain Python (`first_diff_cols`,
    `position_cols`, `answer_ids`, read off the tokenizer's output): laying out thousands of
    patched runs reads them per cell and pair, and on a GPU each read of a device value would make
    the host wait for the queue. `tokens` lives on the model's device, where the metric reads it.
    A group built without the host lists (from another group's tensors) derives them once: the
    columns from the host tensors at once, the answer ids when the metric first needs them.
    """

    index: list[int]
    batch: Any  # tomlens.models.tokens.EncodedBatch
    tokens: Int[Tensor, "story 2"]  # answer token ids of every story, on the model's device
    first_diff: Int[Tensor, " g"]  # padded column, in the clean row, of the first token where clean != corrupted (host)
    positions: dict[str, Int[Tensor, " g"]]  # selector -> padded column in the clean row (host)
    first_diff_cols: list[int] | None = None  # `first_diff` as Python ints
    position_cols: dict[str, list[int]] | None = None  # `positions` as Python ints
    answer_ids: list[list[int]] | None = None  # `tokens` as Python ints
    # selector -> padded column in the corrupted row, where some pair puts a role at another token there
    # than in its clean story (role-aligned pairs); None: every selector is at the clean row's token
    corrupted_cols: dict[str, list[int]] | None = None
    # pairs whose two stories have different token counts (role-aligned): only selectors patch them
    unequal: list[bool] | None = None
    # pairs declared role-aligned (`MinimalPair.alignment == "roles"`): worded differently, so a column
    # is not one token in both stories even where their token counts are equal
    roles: list[bool] | None = None
    _vocab: tuple[Tensor, Tensor] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.first_diff_cols is None:
            self.first_diff_cols = [int(x) for x in self.first_diff.tolist()]
        if self.position_cols is None:
            self.position_cols = {k: [int(x) for x in v.tolist()] for k, v in self.positions.items()}

    @property
    def g(self) -> int:
        return len(self.index)

    @property
    def width(self) -> int:
        return int(self.batch.input_ids.shape[1])

    def pad(self, j: int) -> int:
        return int(self.batch.pad[j])

    def column(self, selector: str, row: int) -> int:
        """Padded column of `selector` in a row of the group's batch (clean rows `0..g-1`, corrupted
        `g..2g-1`): a role-aligned pair's two stories may hold the role at different tokens."""
        assert self.position_cols is not None
        g = self.g
        if row >= g and self.corrupted_cols is not None:
            return self.corrupted_cols[selector][row - g]
        return self.position_cols[selector][row % g]

    def first_diff_token(self, j: int) -> int:
        """Unpadded index of the first token where pair `j`'s two stories differ (before it, both
        stories are the same tokens at the same indexes)."""
        assert self.first_diff_cols is not None
        return self.first_diff_cols[j] - self.pad(j)

    def role_aligned(self, j: int) -> bool:
        """Whether pair `j` is patched by role only: declared role-aligned, or its two stories have
        different token counts (so column k is not the same token in both)."""
        return bool((self.unequal and self.unequal[j]) or (self.roles and self.roles[j]))

    @property
    def any_role_aligned(self) -> bool:
        return any(self.role_aligned(j) for j in range(self.g)) or self.corrupted_cols is not None

    def metric_vocab(self) -> tuple[Int[Tensor, " v"], Int[Tensor, "story 2"]]:
        """(vocab, answer) on the model's device: the metric's token ids, once each and sorted, and
        every story's two answer tokens as indices into them (a forward then unembeds only
        `vocab`). Built on the host from `answer_ids` and moved once per group."""
        if self._vocab is None:
            if self.answer_ids is None:  # a group built from another's tensors: read them once
                self.answer_ids = [[int(a), int(b)] for a, b in self.tokens.tolist()]
            vocab = sorted({t for row in self.answer_ids for t in row})
            where = {t: i for i, t in enumerate(vocab)}
            answer = [[where[a], where[b]] for a, b in self.answer_ids]
            device = self.tokens.device
            self._vocab = (to_device(torch.tensor(vocab, dtype=torch.long), device),
                           to_device(torch.tensor(answer, dtype=torch.long).view(-1, 2), device))
        return self._vocab


@dataclass
class PreparedPairs:
    """Pairs tokenised once for a model: groups, answer tokens, aligned position labels."""

    pairs: list[Any]
    groups: list[Group]
    lengths: list[int]
    n_aligned: int
    token_labels: list[str]
    selectors: tuple[str, ...]

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self.pairs]


def _other(options: tuple[str, str], answer: str) -> str:
    return options[1] if options[0] == answer else options[0]


def prepare_pairs(
    model: Model, pairs: Sequence[Any], *, selectors: Sequence[str] = (), batch_pairs: int = 8
) -> PreparedPairs:
    """Tokenise pairs for `model`, check they are aligned, resolve selector positions.

    Pairs are sorted by length into groups of `batch_pairs` so a group carries little padding.
    """
    from tomlens.models.tokens import encode

    pairs = list(pairs)
    if not pairs:
        raise TomlensError("no minimal pairs to patch", "generate pairs with `tomlens pairs` first")
    for p in pairs:
        if tuple(p.clean.options) != tuple(p.corrupted.options):
            raise TomlensError(
                f"pair {p.id!r}: clean and corrupted stories have different options "
                f"({list(p.clean.options)} vs {list(p.corrupted.options)})",
                "build pairs with tomlens.stimuli.pairs.make_pairs",
            )
    selectors = tuple(s for s in selectors if s not in ("all", "each"))
    options = [(p.clean.answer, _other(p.clean.options, p.clean.answer)) for p in pairs]
    tokens = option_first_tokens(model, [p.clean for p in pairs], options).tolist()  # host, once
    clean_ids = _host_ids(model, [p.clean.text for p in pairs])
    corrupted_ids = _host_ids(model, [p.corrupted.text for p in pairs])
    lengths = [len(x) for x in clean_ids]
    order = sorted(range(len(pairs)), key=lambda i: (-lengths[i], i))
    groups: list[Group] = []
    labels: list[str] | None = None
    for a in range(0, len(order), max(1, batch_pairs)):
        idx = order[a : a + batch_pairs]
        g = len(idx)
        batch = encode(model, [pairs[i].clean.text for i in idx] + [pairs[i].corrupted.text for i in idx])
        rows = [clean_ids[i] for i in idx] + [corrupted_ids[i] for i in idx]
        if [len(r) for r in rows] != list(batch.lengths):
            raise TomlensError("the model's tokenizer gave different tokens for the same texts on a second call",
                               "use a deterministic (fast) tokenizer; patching plans columns from its output")
        first: list[int] = []
        unequal: list[bool] = []
        for j, i in enumerate(idx):
            unequal.append(batch.lengths[j] != batch.lengths[g + j])
            if unequal[-1] and getattr(pairs[i], "alignment", "tokens") != "roles":
                raise TomlensError(
                    f"pair {pairs[i].id!r} is not aligned: the clean story has {batch.lengths[j]} "
                    f"tokens, the corrupted one {batch.lengths[g + j]}",
                    "align pairs for this model's tokenizer with tomlens.stimuli.pairs.align_pairs, or mark "
                    "pairs of differently worded stories alignment='roles' (tomlens pairs user does)",
                )
            first.append(_first_difference(rows[j], rows[g + j], batch.pad[j], batch.input_ids.shape[1]))
        cols, corrupted_cols = _selector_columns(pairs, idx, batch, selectors)
        answers = [tokens[i] for i in idx]
        answers = answers + answers
        if labels is None:  # the first group holds the longest pairs
            labels = _token_labels(model, rows[0], rows[g], batch.pad[0], max(lengths))
        groups.append(Group(
            idx, batch, to_device(torch.tensor(answers, dtype=torch.long).view(-1, 2), batch.input_ids.device),
            torch.tensor(first, dtype=torch.long), {k: torch.tensor(v, dtype=torch.long) for k, v in cols.items()},
            first, cols, answers, corrupted_cols, unequal,
            [getattr(pairs[i], "alignment", "tokens") == "roles" for i in idx],
        ))
    # right-aligned positions span the longest story, clean or corrupted (a role-aligned pair's
    # corrupted story may be the longer)
    n_aligned = max(max(lengths), max(len(x) for x in corrupted_ids))
    assert labels is not None
    return PreparedPairs(pairs, groups, lengths, n_aligned, labels, selectors)


def _host_ids(model: Model, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of `texts` as `tomlens.models.tokens.encode` makes them (the model's tokenizer, its
    own special tokens, no padding), as Python lists: read on the host, not off the device batch."""
    enc = model.tokenizer(list(texts), padding=False, truncation=False)
    return [list(map(int, ids)) for ids in enc["input_ids"]]


def _first_difference(clean: Sequence[int], corrupted: Sequence[int], pad: int, width: int) -> int:
    """Padded column, in the clean row, of the first token where two stories differ: the first
    unequal token, or where the shorter one ends (`width` if they are the same)."""
    t = next((t for t, (a, b) in enumerate(zip(clean, corrupted, strict=False)) if a != b), None)
    if t is None:
        return width if len(clean) == len(corrupted) else pad + min(len(clean), len(corrupted))
    return pad + t


def _selector_columns(pairs: Sequence[Any], idx: Sequence[int], batch: Any, selectors: Sequence[str]
                      ) -> tuple[dict[str, list[int]], dict[str, list[int]] | None]:
    """(clean columns, corrupted columns or None) of each selector in each pair of a group, padded,
    from the tokenizer's offsets. A token-aligned pair must hold the selector at the same token in
    both stories (refused otherwise); a role-aligned pair holds it wherever its own story does, and
    a patch then carries the clean story's value at its token to the corrupted story's token."""
    if not selectors:
        return {}, None
    from tomlens.models.positions import host_positions, parse_selectors

    g = len(idx)
    stories = [pairs[i].clean for i in idx] + [pairs[i].corrupted for i in idx]
    parse_selectors(list(selectors))  # refuses a malformed one
    pos = host_positions(stories, batch, [sel.strip() for sel in selectors])
    clean: dict[str, list[int]] = {}
    corrupted: dict[str, list[int]] = {}
    for s_i, sel in enumerate(selectors):
        c, r = [row[s_i] for row in pos[:g]], [row[s_i] for row in pos[g:]]
        moved = [j for j in range(g) if c[j] - batch.pad[j] != r[j] - batch.pad[g + j]]
        token_aligned = [j for j in moved if getattr(pairs[idx[j]], "alignment", "tokens") != "roles"]
        if token_aligned:
            j = token_aligned[0]
            raise TomlensError(
                f"pair {pairs[idx[j]].id!r}: position {sel!r} is token {c[j] - batch.pad[j]} in the "
                f"clean story and {r[j] - batch.pad[g + j]} in the corrupted one",
                "patch at selectors outside the contrast span, or re-align the pairs",
            )
        clean[sel], corrupted[sel] = c, r
    same = all(clean[sel][j] == corrupted[sel][j] for sel in selectors for j in range(g))
    return clean, None if same else corrupted


def _token_labels(model: Model, clean: Sequence[int], corrupted: Sequence[int], pad: int, n_aligned: int) -> list[str]:
    """Axis labels for right-aligned positions, from the longest pair's token ids ("clean|corrupted"
    where the two stories differ); `pad` is that pair's left padding in its group."""
    width = pad + len(clean)
    out = []
    for k in range(n_aligned):
        t = width - n_aligned + k - pad  # index into the unpadded ids
        if t < 0:
            out.append(f"{k}")
            continue
        a = model.tokenizer.decode([clean[t]])
        tk = t - len(clean) + len(corrupted)  # right-aligned in the corrupted story too
        b = model.tokenizer.decode([corrupted[tk]]) if tk >= 0 else ""
        out.append(f"{k}:{a}" if a == b else f"{k}:{a}|{b}")
    return out


def roles(direction: Direction, g: int, j: int) -> tuple[int, int]:
    """(base row, source row) of pair j: denoising runs the corrupted story with clean values."""
    if direction == "denoise":
        return g + j, j
    if direction == "noise":
        return j, g + j
    raise TomlensError(f"unknown patching direction {direction!r}", "use 'denoise' or 'noise'")


def as_prepared(
    model: Model, pairs: Sequence[Any] | PreparedPairs, selectors: Sequence[str] = (), batch_pairs: int = 8
) -> PreparedPairs:
    """Pairs already prepared as they are, else prepared for `model` with `selectors` (so every
    sweep accepts either)."""
    if isinstance(pairs, PreparedPairs):
        return pairs
    return prepare_pairs(model, pairs, selectors=selectors, batch_pairs=batch_pairs)


def tokens_hash(prepared: PreparedPairs) -> str:
    """Content hash of what every story of `prepared` runs on: per group, its pairs, token ids (with
    their padding), answer tokens and selector columns. A setting that changes none of these (a BOS
    rule the tokenizer already follows) leaves it unchanged; one that changes the tokens does not.
    What a patch run's resume key reads instead of the raw setting."""
    import hashlib
    import json

    h = hashlib.sha256()
    for group in prepared.groups:
        plain = [[int(i) for i in group.index], list(group.batch.pad), group.tokens.tolist(),
                 group.first_diff_cols, group.position_cols]
        if group.corrupted_cols is not None:  # role-aligned pairs only, so older keys stay as they were
            plain.append(group.corrupted_cols)
        h.update(json.dumps(plain, sort_keys=True).encode())
        h.update(group.batch.input_ids.detach().cpu().numpy().astype("int64").tobytes())
    return h.hexdigest()[:16]
