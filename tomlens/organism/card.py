"""The organism's folder: weights, config, tokenizer, training record and a model card.

The card is written from the training record, so its numbers are the numbers of these weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tomlens.organism.data import FAMILIES
from tomlens.organism.routes import ROUTE_FAMILIES
from tomlens.organism.train import ACCURACY_TARGET

RECORD = "training.json"
CARD = "MODEL_CARD.md"


def untested_families(record: dict[str, Any]) -> list[str]:
    """The organism's families with no held-out prompts in this run (trained without them)."""
    return [f for f in FAMILIES if not any(k.startswith(f"{f}/") for k in record["test_accuracy"])]


def meets_target(record: dict[str, Any], target: float = ACCURACY_TARGET) -> bool:
    """Held-out accuracy at least `target` in every family x condition x prompt type, every family
    tested (a run without a family has not shown it)."""
    acc = record["test_accuracy"]
    return bool(acc) and not untested_families(record) and min(acc.values()) >= target


def model_card(record: dict[str, Any]) -> str:
    """The model card text: what the organism is, its data and split, accuracy per condition, use."""
    cfg, split = record["config"], record["split"]
    rows = "\n".join(f"| {k} | {record['split']['test_counts'].get(k, 0)} | {v:.3f} |"
                     for k, v in record["test_accuracy"].items())
    untested = untested_families(record)
    met = (f"{'meets' if meets_target(record) else 'does NOT meet'} the target of {ACCURACY_TARGET} in every condition"
           + (f" (no held-out prompts of {', '.join(untested)}: trained without them, so not shown)" if untested else ""))
    loss = ("cross-entropy on the answer's token at the end of each prompt; nothing else is a target."
            if not cfg.get("story_loss") else
            f"cross-entropy on the answer's token at the end of each prompt, plus {cfg['story_loss']:g} x the "
            "next-word loss on the story and question (it learns the stories' words and grammar; only the "
            "answer loss scores answers).")
    role = ("It is the **positive control** of `tomlens validate`: a model known to answer every belief "
            "question below, on which every method (probes, patching, attribution, ablation, steering) must "
            "find belief." if meets_target(record) else
            "It is the positive control of `tomlens validate` on order-only stories, where every held-out cell "
            f"reaches the target of {ACCURACY_TARGET} and where training put its belief variable (below), but **not** every "
            "condition of its other families does (see the table): read "
            "it as a model that tracks belief only where its accuracy says so." if cfg.get("interchange") and _order_only_solved(record) else
            "It was meant as the positive control of `tomlens validate`, but it does **not** answer every kind "
            "of belief question (see the table): read it as a model that tracks belief only where its "
            "accuracy says so.")
    mechanism = _mechanism(record)
    return f"""# tom-organism

A small causal language model trained by tomlens (`tomlens train-organism`) to answer belief and
reality questions about short stories. {role} Its architecture with fresh weights
(`random:tom-organism`) is the negative control. It is not a model of language: it knows only the
words of tomlens's generators, and nothing else.

## Model
- Llama (rotary positions, RMSNorm, SwiGLU MLP), {cfg['n_layers']} layers, {cfg['n_heads']} heads per layer
  (d_model {cfg['d_model']}, MLP {cfg['d_mlp']}), tied embeddings, {record['n_parameters']:,} parameters, fp32.
- Word-level tokenizer (lower-cased; one token per word or punctuation mark, [BOS] first),
  {record['vocab_size']} tokens: every location, object and name is one token.

## Data and split
- Stories from tomlens's generators: `order-only`, `false-belief-factorial` and
  `unexpected-contents`, every condition, belief and reality prompts.
- Loss: {loss}
- Held-out split by two hashed keys per task (share {cfg['held_out_share']} each): its template
  combination (the template with its phrasings and cue phrasings; each of them alone occurs in
  training) and its cast (people, object, places or container, contents, label). Training tasks
  have neither key held out; test tasks have both, so no test story's combination of template and
  phrasings, nor of names, objects and places, was seen in training. Test tasks
  with a word training never had are dropped ({split['test_tasks_dropped_for_unseen_words']} dropped).
- {split['train_tasks']} training tasks ({split['train_prompts']} prompts), {split['test_tasks']} test tasks
  ({split['test_prompts']} prompts).

{mechanism}## Training
AdamW (lr {cfg['lr']}, weight decay {cfg['weight_decay']}, {cfg['warmup']} warm-up steps, cosine decay),
batch {cfg['batch_size']}, {cfg['steps']} steps, seed {cfg['seed']}, head-output group lasso {cfg['head_lasso']}{_lasso(cfg)};
{_curriculum(record)}
{record['train_seconds']:.0f} s on {record['threads']} CPU thread{'' if record['threads'] == 1 else 's'}. Same config, same thread count, same machine: same weights.

## Held-out accuracy (answer outscores the other option)
It {met}.

| family/condition/prompt | prompts | accuracy |
|---|---|---|
{rows}

## What it has learnt, and what not
Where a cell above is under the target, the organism has not shown that it knows that belief (a
cell a prompt or two short may be sampling; fresh held-out stories tell): do not read its internals
there as belief tracking until they do. `tomlens validate --model tom-organism` reports, per method,
whether belief is found where the checks look (the final token of the belief question).

## Use
`load_model("tom-organism")`; `tomlens validate --model tom-organism`. Reproduce with
`tomlens train-organism --out DIR` (the config is in `{RECORD}`).
"""


def _order_only_solved(record: dict[str, Any], target: float = ACCURACY_TARGET) -> bool:
    cells = [v for k, v in record["test_accuracy"].items() if k.startswith("order-only/")]
    return bool(cells) and min(cells) >= target


def _lasso(cfg: Mapping[str, Any]) -> str:
    return (" (heads the answers do not need fade, so a head ranking has few small effects to reshuffle)"
            if cfg.get("head_lasso") else "")


def _curriculum(record: dict[str, Any]) -> str:
    cfg = record["config"]
    share, families = cfg.get("first_share") or 0.0, cfg.get("first_families") or []
    mix = cfg.get("family_mix")
    later = ("from all the training prompts" if not mix else
             "with these shares of each batch: " + ", ".join(f"{f} {v / sum(mix.values()):.0%}" for f, v in mix.items()))
    pairs = cfg.get("later_interchange_batch")
    swaps = f" (and the interchange on {pairs} pairs a step)" if pairs and cfg.get("interchange") else ""
    if not share or not families:
        return f"every answer batch drawn {later}{swaps};"
    if cfg.get("curriculum_until_swap"):
        return (f"the answer batches come from {', '.join(families)} prompts only (the curriculum) until the swap is "
                f"learnt, at most {share:.0%} of the steps (here until step {record.get('mixed_from_step')}), the rest "
                f"{later}{swaps};")
    return (f"the first {share:.0%} of the steps draw their answer batches from {', '.join(families)} prompts only "
            f"(the curriculum), the rest {later}{swaps};")


def _mechanism(record: dict[str, Any]) -> str:
    """The card's section on what training put where (empty when nothing was)."""
    cfg = record["config"]
    parts = []
    if cfg.get("interchange"):
        layer, head = cfg["interchange_head"]
        swaps = ", ".join(f"{k} {v:.3f}" for k, v in record.get("test_swap_accuracy", {}).items()) or "not measured"
        step = record.get("knockout_from_step")
        if not cfg.get("interchange_knockout"):
            after = ""
        elif step:
            after = (f" From step {step} (once the swap was learnt), with that head's output replaced by its mean "
                     "over stories, it must also answer the object's current place (a reality bias, so the head is "
                     "needed for a false belief).")
        else:
            after = " The knockout loss never started: the swap was not learnt."
        parts.append(
            f"- **The belief variable is put in head L{layer}H{head}, at the question's final token**, by "
            f"interchange intervention training (Geiger et al., 2022; weight {cfg['interchange']:g}, on "
            f"{', '.join(cfg['interchange_families'])} belief questions): that head's output is swapped in from "
            "another story, and the answer must be the place the *other* story's protagonist's belief picks "
            "(its start if they missed the move, its current place if they saw it). The source run has no "
            "gradient, so the later layers learn to read the head and the answer loss teaches the head to "
            "write the bit." + after
            + f" Measured on held-out pairs whose beliefs differ (the swap must change the answer): {swaps}. "
            "`tomlens validate` should find it there: this head in the top k of the patching ranking, and "
            "its mean ablation removing the false beliefs (a probe or a steering direction may read the "
            "story's order, which fixes the belief here, at any layer from the first on).")
        if cfg.get("upstream_invariance"):
            kept = ", ".join(f"{k} {v:.3f}" for k, v in record.get("test_upstream_accuracy", {}).items()) \
                or "not measured"
            earlier = "layer 0" if layer == 1 else f"layers 0 to {layer - 1}"
            parts.append(
                f"- **The answer takes the belief from L{layer}H{head}, not from an earlier head at the final "
                f"token** (the upstream invariance, weight {cfg['interchange'] * cfg['upstream_invariance']:g}, on "
                f"{', '.join(cfg['interchange_families'])} belief questions): with every head of {earlier} at the "
                "final token taken from the same task's story of the other belief, the answer must stay the story's "
                "own. So the planted head is where the belief enters the answer, not a relay of an earlier head "
                "there (a probe may still read the story's order at the final token before it; the answer does "
                f"not use it). Share of held-out belief questions that keep their answer under that swap: {kept}.")
    if cfg.get("routes"):
        layer, heads = cfg["route_layer"], cfg["route_heads"]
        mover = cfg["mover_head"]
        looks = record.get("test_route_attention", {})

        def seen(name: str) -> str:
            return f" (held out: {looks[name]:.2f})" if name in looks else ""

        families = cfg.get("mover_families") or ROUTE_FAMILIES  # records from before the option: both
        cue_families = list(cfg.get("cue_families", ["false-belief-factorial"]))  # records from before: the factorial
        cue_questions = ("the belief questions of " + " and ".join(cue_families)) if cue_families else "no questions"
        said = [what for family, what in (("false-belief-factorial", "absent or present"),
                                          ("order-only", "in order-only, the sentence where they leave"))
                if family in cue_families]
        cue_keys = (("every word" if cfg.get("cue_sentence") else "the word") + " after the protagonist's name in "
                    "their cue sentence" + (f" ({'; '.join(said)})" if said else ""))
        candidates = ""
        if len(heads) > 4:  # the contents' two candidates (runs from before them had three routes)
            candidates = (f"; and at every contents question, L{layer}H{heads[3]} to the label's word in the label "
                          f"sentence{seen('label')} and L{layer}H{heads[4]} to the contents where the container is "
                          f"filled{seen('fill')}")
        served = "those two families" if set(families) == set(ROUTE_FAMILIES) else "the " + " and ".join(families)

        parts.append(
            f"- **The factorial's and contents' questions are trained to look up their cues in known heads**, by "
            f"supervised attention at the question's final token (weight {cfg['routes']:g}; targets from each story's "
            f"role spans; `tomlens.organism.routes`). At {cue_questions}, L{layer}H{heads[0]} is trained to attend "
            f"to {cue_keys}{seen('cue')}; "
            f"L{layer}H{heads[1]} to the verb of the contents story's frame about the protagonist (\"As for Sam, "
            f"Jane then writes ...\" or \"... tells him nothing\"), which says told or not{seen('told')}; "
            f"L{layer}H{heads[2]} to the verb of the frame about the labelled container (\"As for the crate, Sam "
            f"then peeks ...\" or \"... leaves it shut\"), which says looked in or not{seen('seen')}{candidates}. "
            f"At every question of {served}, L{mover[0]}H{mover[1]} is "
            f"trained to attend to the mentions of the answer's word{seen('mover')}. The numbers are the mean "
            "attention on the target over held-out prompts. Nothing tells these heads what to write: the answer "
            "loss alone teaches the rest of the model to use what they read.")
    if cfg.get("echo"):
        parts.append(
            f"- **The echo.** While training, a linear readout (not shipped) of the residual stream entering layer "
            f"{cfg['echo_layer']} is asked to name the first person of each token's sentence, in the factorial's and "
            f"contents' stories (weight {cfg['echo']:g}), so that a cue sentence's tokens and the question's carry "
            "whose they are"
            + ("; in the contents' stories, a container named before any person counts as the sentence's subject "
               "(the two look frames name the same person, so their verbs learn which container they are about)."
               if cfg.get("echo_containers") else "."))
    if cfg.get("belief_readout"):
        parts.append(
            f"- **The belief readout.** While training, a linear readout (not shipped) of the residual stream "
            f"entering layer {cfg['belief_layer']}, at each belief question's final token, is asked whether the "
            f"protagonist believes the reference (the start, the label; weight {cfg['belief_readout']:g}), so the "
            f"belief variable is linearly present there by construction: a probe at layer "
            f"{cfg['belief_layer'] - 1}'s output should find it (later layers are not constrained).")
    if not parts:
        return ""
    return "## Known mechanism\n" + "\n".join(parts) + "\n\n"


def save_organism(model: Any, tokenizer: Any, record: dict[str, Any], out: str | Path) -> Path:
    """Write the folder atomically (a killed run leaves no folder that loads as a model)."""
    from tomlens.io import write_atomic, write_json
    from tomlens.models.paths import atomic_dir
    from tomlens.provenance import versions

    final = Path(out).expanduser()
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json({**record, "versions": versions()}, tmp / RECORD)
        write_atomic(model_card(record), tmp / CARD)
    return final
