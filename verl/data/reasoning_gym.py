"""``reasoning_gym:`` sources: reasoning-gym's procedural datasets as prompts, scored by their own ``score_answer``.

Names (docs/environments.md):

- ``reasoning_gym:<dataset>[?size=N&seed=S&<config key>=<value>...]`` — one generator; config keys are the
  dataset's own (``reasoning_gym.factory.DATASETS[name][1]``), values YAML (``ops=[+,-]``, ``min_terms=2``);
- ``reasoning_gym:mix?chain_sum=1&leg_counting=2[&size=N&seed=S&chain_sum.<key>=<value>]`` — reasoning-gym's own
  ``composite`` dataset with those weights; or ``reasoning_gym:FILE.yaml`` in its ``CompositeConfig`` format;
- ``system_prompt=<name of reasoning_gym.utils.SYSTEM_PROMPTS>|none`` (default ``default``), as reasoning-gym's
  eval scripts prompt: that system message, then the question as the user's.

Item *i* is reasoning-gym's ``dataset[i]`` (``Random(seed + i)``). Rows carry ``data_source`` =
``reasoning_gym/<dataset>`` (for a mix, the item's own dataset), ``extra_info`` = {source, seed, index, kind (the
dataset: per-task metrics), spec, items (the generator's id: with seed and index, the sample's identity, so two runs
on the same items pair whatever their prompts)}; the reward (``reward.name=auto``) rebuilds the item from the spec
and scores ``extract_answer(response)`` (the last ``<answer>...</answer>``) with the dataset's ``score_answer``: the
score and ``acc`` are that value, ``format`` whether an answer tag was found; a scorer that raises on an answer it
cannot parse (prime_factorization's does) scores it 0 and counts it in ``scorer_refused``. ``response`` is the item's
answer in that format (``<answer>...</answer>``): ``verl sft`` on such rows is a format cold start (train it on tasks
the RL run neither trains nor reports on: it supervises the answers themselves).

**Validation is disjoint from training**: a validation source whose items overlap a training source of the same
generator and config (seeds ``seed .. seed + size - 1``; a mix's sub-dataset ``k`` from ``seed + k + 1``, as
reasoning-gym's composite seeds it) starts after the training range instead, and validation
questions equal to a training question after normalisation (small generators repeat) are dropped; both are counted
in the written file's ``<file>.json`` and said in the log.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from verl.data.builtin import write_parquet
from verl.data.contamination import normalise
from verl.data.sources import SourceName
from verl.errors import DataError, MissingDependencyError
from verl.utils.fs import atomic_write_json, cache_dir

SCHEME = "reasoning_gym"
DATA_SOURCE_PREFIX = "reasoning_gym/"
MIX = "mix"
DEFAULT_SIZE, DEFAULT_SEED = 500, 0
INSTALL = "pip install -e '.[envs]' (it compiles pycosat: needs a C compiler)"
ROW_FORMAT = "2"  # in the cache key: a change to what a row holds writes the files again


def _package():
    try:
        import reasoning_gym  # noqa: PLC0415 - lazy: a run without reasoning_gym: sources never imports it
        import reasoning_gym.utils  # noqa: PLC0415
    except ImportError:
        raise MissingDependencyError("reasoning-gym", "reasoning_gym: data sources", INSTALL) from None
    return reasoning_gym


@dataclass(frozen=True)
class ReasoningGymSpec:
    """One source's items: a dataset (or a weighted mix) with its config, ``size`` items from ``seed``."""

    dataset: str  # a reasoning-gym dataset name, or "mix"
    config: dict[str, Any] = field(default_factory=dict)  # the dataset's config keys (a mix: name -> its config)
    weights: dict[str, float] = field(default_factory=dict)  # a mix's datasets and weights
    size: int = DEFAULT_SIZE
    seed: int = DEFAULT_SEED
    system_prompt: str = "default"

    def generator_id(self) -> str:
        """The generator(s) and config, not the size, seed or prompt: with (seed, index), an item's identity."""
        key = json.dumps([self.dataset, self.config, self.weights], sort_keys=True)
        return f"reasoning_gym:{self.dataset}:{hashlib.sha256(key.encode()).hexdigest()[:10]}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _check_config(where: str, dataset: str, config: dict[str, Any]) -> None:
    """Refuse a config key the dataset does not have, by name, with the keys it has."""
    datasets = _package().factory.DATASETS
    if dataset not in datasets:
        close = difflib.get_close_matches(dataset, list(datasets), n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise DataError(f"{where}: reasoning-gym has no dataset '{dataset}'; {hint}it has {len(datasets)} (python -c "
                        "'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")
    known = {f.name for f in fields(datasets[dataset][1])} - {"seed", "size"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise DataError(f"{where}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a config key of "
                        f"reasoning-gym's '{dataset}'; its keys are {', '.join(sorted(known))}")


def parse_spec(source: SourceName) -> ReasoningGymSpec:
    """A ``reasoning_gym:`` name as a spec, its keys checked against reasoning-gym's configs."""
    params = dict(source.params)
    where = f"data source '{source.text}'"
    common: dict[str, Any] = {}
    for key, kind in (("size", int), ("seed", int)):
        if key in params:
            try:
                common[key] = kind(params.pop(key))
            except ValueError:
                raise DataError(f"{where}: {key} must be an integer") from None
    if common.get("size", 1) < 1:
        raise DataError(f"{where}: size must be at least 1")
    prompt = params.pop("system_prompt", "default")
    prompts = _package().utils.SYSTEM_PROMPTS
    if prompt != "none" and prompt not in prompts:
        raise DataError(f"{where}: system_prompt must be none or one of reasoning-gym's {', '.join(prompts)}")
    target = source.target
    if target.endswith((".yaml", ".yml")):
        return _spec_from_yaml(Path(target), where, common, prompt, params)
    if target == MIX:
        weights, config = {}, {}
        for key, value in params.items():
            name, dot, sub = key.partition(".")
            if dot:
                config.setdefault(name, {})[sub] = _value(value)
                continue
            try:
                weights[name] = float(value)
            except ValueError:
                raise DataError(f"{where}: the mix weight of '{key}' must be a number, got '{value}'") from None
        if not weights:
            raise DataError(f"{where}: a mix names its datasets with weights, e.g. "
                            "reasoning_gym:mix?chain_sum=1&leg_counting=2")
        for name in sorted(set(config) - set(weights)):
            raise DataError(f"{where}: '{name}.*' configures a dataset the mix does not weight; add {name}=<weight>")
        for name in weights:
            _check_config(where, name, config.get(name, {}))
        return ReasoningGymSpec(MIX, config, weights, system_prompt=prompt, **common)
    config = {key: _value(value) for key, value in params.items()}
    _check_config(where, target, config)
    return ReasoningGymSpec(target, config, system_prompt=prompt, **common)


def _spec_from_yaml(path: Path, where: str, common: dict, prompt: str, params: dict) -> ReasoningGymSpec:
    """reasoning-gym's composite YAML: ``{size, seed, datasets: [{name, weight, config}]}``."""
    if params:
        raise DataError(f"{where}: a mix file takes only size, seed and system_prompt in the name; put "
                        f"{', '.join(sorted(params))} in the file")
    if not path.is_file():
        raise DataError(f"{where}: no file '{path}'")
    try:
        data = yaml.safe_load(path.read_text()) or {}
        items = data["datasets"]
        weights = {item["name"]: float(item.get("weight", 1.0)) for item in items}
        config = {item["name"]: dict(item.get("config") or {}) for item in items if item.get("config")}
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{where}: {path} is not a reasoning-gym composite file (datasets: [{{name, weight, "
                        f"config}}]): {exc}") from None
    for name in weights:
        _check_config(f"{where} ({path})", name, config.get(name, {}))
    base = {"size": int(data.get("size", DEFAULT_SIZE)), "seed": int(data.get("seed", DEFAULT_SEED)), **common}
    return ReasoningGymSpec(MIX, config, weights, system_prompt=prompt, **base)


@functools.lru_cache(maxsize=64)
def build(spec_json: str):
    """reasoning-gym's dataset object for a spec (cached: the reward rebuilds items from it)."""
    rg = _package()
    spec = ReasoningGymSpec(**json.loads(spec_json))
    if spec.dataset != MIX:
        return rg.create_dataset(spec.dataset, size=spec.size, seed=spec.seed, **spec.config)
    from reasoning_gym.composite import DatasetSpec  # noqa: PLC0415

    specs = [DatasetSpec(name=name, weight=weight, config=dict(spec.config.get(name, {})))
             for name, weight in spec.weights.items()]
    return rg.create_dataset("composite", size=spec.size, seed=spec.seed, datasets=specs)


@functools.lru_cache(maxsize=4096)
def entry(spec_json: str, index: int) -> dict:
    return build(spec_json)[index]


def _row(spec: ReasoningGymSpec, name: str, index: int, item: dict) -> dict:
    system = _package().utils.SYSTEM_PROMPTS.get(spec.system_prompt)
    dataset = (item.get("metadata") or {}).get("source_dataset") or spec.dataset
    prompt = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": item["question"]}]
    return {"data_source": DATA_SOURCE_PREFIX + dataset, "prompt": prompt, "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": str(item["answer"])},
            "response": f"<answer>{item['answer']}</answer>",  # the format's demonstration: verl sft's cold start
            "extra_info": {"source": name, "seed": spec.seed, "index": index, "kind": dataset,
                           "spec": spec.to_json(), "items": spec.generator_id()}}


def _question_key(item: dict) -> str:
    return " ".join(normalise(str(item["question"])))


def _generators(spec: ReasoningGymSpec) -> list[tuple[str, str, int]]:
    """(dataset, its config as JSON, seed offset) of each generator a spec draws from: its item ``i`` of that
    generator is ``Random(spec.seed + offset + i)``. One dataset: offset 0; a mix (reasoning-gym's composite):
    sub-dataset ``k`` is seeded ``seed + k + 1``."""
    if spec.dataset != MIX:
        return [(spec.dataset, json.dumps(spec.config, sort_keys=True), 0)]
    return [(name, json.dumps(spec.config.get(name, {}), sort_keys=True), k + 1) for k, name in enumerate(spec.weights)]


def disjoint(spec: ReasoningGymSpec, training: Sequence[ReasoningGymSpec]) -> ReasoningGymSpec:
    """``spec`` moved to the first seed at which none of its generators' seed ranges (``seed + offset .. + size``)
    overlaps a training range of the same generator and config — single datasets and mixes alike."""
    ranges = [(name, config, train.seed + offset, train.size) for train in training
              for name, config, offset in _generators(train)]
    moved = True
    while moved:
        moved = False
        for name, config, offset in _generators(spec):
            start = spec.seed + offset
            for other, other_config, train_start, train_size in ranges:
                if (name, config) == (other, other_config) and start < train_start + train_size and \
                        train_start < start + spec.size:
                    spec = replace(spec, seed=train_start + train_size - offset)
                    moved = True
                    break
            if moved:
                break
    return spec


def materialize_source(source: SourceName, _arithmetic: Any = None, disjoint_from: Sequence[SourceName] = ()) -> Path:
    """The cached parquet of a source's items (written once per spec); with training sources, validation items
    disjoint from theirs (see the module docstring)."""
    spec = parse_spec(source)
    training = [parse_spec(t) for t in disjoint_from if t.scheme == SCHEME]
    moved = disjoint(spec, training)
    key = _key_of([moved], source.text, ROW_FORMAT) + (f"-vs-{_key_of(training)}" if training else "")
    path = cache_dir() / "data" / f"reasoning_gym-{key}" / "items.parquet"
    if path.exists():
        if training and path.with_suffix(".json").is_file():  # said on every run, not only the first
            _say(json.loads(path.with_suffix(".json").read_text()))
        return path
    seen = {_question_key(entry(t.to_json(), i)) for t in training for i in range(t.size)}
    rows, dropped = [], 0
    dataset = build(moved.to_json())
    for index in range(moved.size):
        item = dataset[index]
        if seen and _question_key(item) in seen:
            dropped += 1
            continue
        rows.append(_row(moved, source.text, index, item))
    if not rows:
        raise DataError(f"data source '{source.text}': every item equals a training question; use a larger "
                        "generator config or another seed")
    summary = {"source": source.text, "seed": moved.seed, "size": moved.size, "rows": len(rows),
               "moved_from_seed": spec.seed if moved.seed != spec.seed else None,
               "dropped_equal_to_training": dropped}
    write_parquet(rows, path)
    atomic_write_json(path.with_suffix(".json"), summary)
    if training:
        _say(summary)
    return path


def _key_of(specs: Sequence[ReasoningGymSpec], *more: str) -> str:
    return hashlib.sha256("|".join([*sorted(s.to_json() for s in specs), *more]).encode()).hexdigest()[:12]


def _say(summary: dict) -> None:
    from verl.utils.log import say_once  # noqa: PLC0415

    moved = (f"items from seed {summary['seed']} (after the training items, not {summary['moved_from_seed']})"
             if summary["moved_from_seed"] is not None else f"items from seed {summary['seed']}")
    say_once(f"validation {summary['source']}: {moved}; {summary['dropped_equal_to_training']} of {summary['size']} "
             "dropped as equal to a training question after normalisation", label="data")


def score(solution_str: str, extra_info: dict | None) -> dict:
    """reasoning-gym's own verdict on a response: ``score_answer(extract_answer(response), item)``."""
    info = extra_info or {}
    if "spec" not in info or "index" not in info:
        raise DataError("a reasoning_gym/* row needs extra_info.spec and extra_info.index (written by reasoning_gym: "
                        "sources and verl data materialize); score other rows with reward.name=<name>")
    rg = _package()
    item = entry(info["spec"], int(info["index"]))
    answer = rg.utils.extract_answer(solution_str)
    try:
        value, refused = float(build(info["spec"]).score_answer(answer, item)), 0.0
    except Exception:  # a task's scorer that cannot parse the model's answer (prime_factorization's int()): wrong,
        value, refused = 0.0, 1.0  # and counted as such (scorer_refused), not a failed step
    return {"score": value, "acc": value, "format": float(answer is not None), "scorer_refused": refused}
