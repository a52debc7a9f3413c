"""The benchmark scenarios: which prompts to send, in which measured steps, how many at once.

Pure and seeded: a scenario and a seed always give the same prompts, so two deployments
(replay slack on, then off) are measured on exactly the same workload. Prompts are token
ids; `pdconnect.bench.loadgen` sends them as ids or renders them as words.

- `ProbeScenario`, the fixed-engine probe: a first remote load of a cold prompt `x+a`,
  the serial sibling `x+b` (must hit locally on decode), two siblings of a fresh `y`
  sent together (with coalescing the second waits for the first's load and hits
  locally), `y+c` after them (must hit locally), and three serial siblings of a fresh
  `z` whose suffixes are longer than a block (the third hits at the shared-prefix
  junction, as a colocated engine does).
- `PrefixRepetitionScenario`: vLLM's `prefix_repetition` dataset
  (`PrefixRepetitionRandomDataset`): `num_prefixes` random prefixes, each followed by
  random suffixes, `num_prefixes * (num_requests // num_prefixes)` requests, shuffled.
- `SharedPrefixScenario`: sglang's `generated-shared-prefix`: groups of questions behind
  one long system prompt per group.
- `MultiTurnScenario`: chat conversations that grow turn by turn: each turn's prompt is
  the previous turn's prompt, its answer (the generated token ids) and a new question;
  one step per turn, the conversations interleaved inside it. Answers exist only once
  the previous turn ran, so a turn's step holds only the new questions and the load
  generator prepends each conversation's history (`Step.turn`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

__all__ = [
    "MultiTurnScenario",
    "PrefixRepetitionScenario",
    "ProbeScenario",
    "Scenario",
    "SharedPrefixScenario",
    "Step",
    "TokenSource",
    "warmup_step",
]

Prompt = tuple[int, ...]


@dataclass
class TokenSource:
    """Random token ids in `[low, high)` from one seeded generator.

    The default range suits any real vocabulary (ids below 1000 exist everywhere and
    hold no end-of-sequence token in the usual tokenizers) and the tiny test models
    (vocabulary 1000, words from id 7). Prompts drawn from one source never share a
    leading block by accident: 984 choices per token.
    """

    seed: int = 0
    low: int = 16
    high: int = 1000
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"token range must satisfy 0 <= low < high, got {self.low}:{self.high}")
        self._rng = random.Random(self.seed)

    @classmethod
    def parse_range(cls, text: str, seed: int = 0) -> TokenSource:
        """`"LOW:HIGH"` -> TokenSource; ValueError names the bad text."""
        low, sep, high = text.partition(":")
        if not sep or not low.strip().isdigit() or not high.strip().isdigit():
            raise ValueError(f"token range must look like LOW:HIGH, got {text!r}")
        return cls(seed=seed, low=int(low), high=int(high))

    def ids(self, length: int) -> Prompt:
        return tuple(self._rng.randrange(self.low, self.high) for _ in range(length))

    def length(self, center: int, jitter: int) -> int:
        """A length drawn uniformly from `[center - jitter, center + jitter]` (at least 1)."""
        return max(1, center + self._rng.randint(-jitter, jitter)) if jitter else center

    def fork(self) -> TokenSource:
        """An independent source seeded from this one: deterministic, disjoint in practice."""
        return TokenSource(seed=self._rng.getrandbits(64), low=self.low, high=self.high)

    def shuffle(self, items: list[Any]) -> None:
        # The permutation depends only on the list's length and the generator.
        self._rng.shuffle(items)


@dataclass(frozen=True)
class Step:
    """One measured unit: `prompts` sent in order, at most `concurrency` in flight.

    Engine counters are read before and after each step, so a step's hit figures are
    its own; steps of one scenario run one after the other.

    `groups`, when given, names each prompt's shared-prefix group (same number = same
    prefix): the report uses it to tell a group's first request from the siblings that
    ran beside it (what coalescing makes wait) and those sent after it.

    `turn` marks conversation steps: 0 = none; 1 = the opening turn (prompt i starts
    conversation i); k > 1 = prompt i is only the new question of conversation i, sent
    after that conversation's previous prompt and answer. Conversation steps keep the
    answers (generated token ids) for the next turn.
    """

    name: str
    prompts: tuple[Prompt, ...]
    output_len: int
    concurrency: int = 1
    turn: int = 0
    groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.output_len < 1:
            raise ValueError(f"step {self.name!r}: concurrency and output_len must be >= 1")
        if self.turn < 0:
            raise ValueError(f"step {self.name!r}: turn must be >= 0")
        if self.groups and len(self.groups) != len(self.prompts):
            raise ValueError(f"step {self.name!r}: {len(self.groups)} groups for {len(self.prompts)} prompts")


class Scenario(Protocol):
    """What the load generator needs from a scenario."""

    name: ClassVar[str]

    def steps(self, tokens: TokenSource) -> list[Step]: ...

    def prompt_len(self) -> int:
        """The usual prompt length, for warm-up requests of the same shape."""
        ...


def _check_positive(owner: object, *names: str) -> None:
    for name in names:
        if getattr(owner, name) < 1:
            raise ValueError(f"{type(owner).__name__}.{name} must be >= 1, got {getattr(owner, name)}")


@dataclass(frozen=True)
class ProbeScenario:
    """The fixed-engine probe: a handful of requests whose expected hits are known.

    With replay slack, `x+b` and `y+c` hit on decode what one colocated engine would
    (for a block-aligned prefix of N tokens: N - A, the EAGLE drop taking one aligned
    block); without it they hit 0 and pull everything again. The overlapping siblings
    reach the decode engine while the first one's load is in flight: with coalescing
    the others wait for it and hit what a serial sibling hits; without, each pulls
    everything.

    The long-suffix siblings `z+a`, `z+b`, `z+c` (suffixes of `long_suffix_len`, longer
    than a block; 0 leaves them out), one after the other: `z+a`'s replay boundary lies
    in its own suffix, so `z+b` finds no sliding-window run inside the prefix and hits
    0, on a colocated engine too; vLLM then keeps `z+b`'s blocks at the shared-prefix
    junction (where its full-attention hit ended), so `z+c` hits there. On decode that
    takes the junction runs in the plan.
    """

    name: ClassVar[str] = "probe"
    prefix_len: int = 1024
    suffix_len: int = 64
    output_len: int = 16
    # Siblings of `y` sent at once in the overlap step.
    overlap: int = 2
    # Suffix of the `z` siblings; above one block (the cache-hit alignment) to test the junction.
    long_suffix_len: int = 300

    def __post_init__(self) -> None:
        _check_positive(self, "prefix_len", "suffix_len", "output_len", "overlap")
        if self.long_suffix_len < 0:
            raise ValueError(f"ProbeScenario.long_suffix_len must be >= 0, got {self.long_suffix_len}")

    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len

    def steps(self, tokens: TokenSource) -> list[Step]:
        def sibling(prefix: Prompt) -> Prompt:
            return prefix + tokens.ids(self.suffix_len)

        x, y = tokens.ids(self.prefix_len), tokens.ids(self.prefix_len)
        together = tuple(sibling(y) for _ in range(self.overlap))
        letters = [chr(ord("a") + i) for i in range(self.overlap + 1)]
        steps = [
            Step("first remote load x+a", (sibling(x),), self.output_len),
            Step("serial sibling x+b", (sibling(x),), self.output_len),
            Step(
                "overlapping " + " ".join(f"y+{c}" for c in letters[:-1]),
                together,
                self.output_len,
                concurrency=self.overlap,
                groups=(0,) * self.overlap,
            ),
            Step(f"after overlap y+{letters[-1]}", (sibling(y),), self.output_len),
        ]
        if self.long_suffix_len:
            # Drawn after everything above, so adding these steps changed no earlier prompt.
            z = tokens.ids(self.prefix_len)
            for i, letter in enumerate("abc"):
                name = f"long suffix z+{letter}" + (f" s{self.long_suffix_len}" if i == 0 else "")
                steps.append(Step(name, (z + tokens.ids(self.long_suffix_len),), self.output_len))
        return steps


def _grouped_step(
    name: str,
    tokens: TokenSource,
    groups: int,
    per_group: int,
    prefix_len: int,
    suffix_len: int,
    shuffle: bool,
    output_len: int,
    concurrency: int,
    suffix_jitter: int = 0,
) -> Step:
    """`groups` random prefixes, each with `per_group` random suffixes; optionally shuffled.

    Each prompt keeps its group number. The shuffle draws as the plain prompt shuffle did,
    so a seed gives the same prompts as before groups were recorded. Suffixes are
    `suffix_len` +/- `suffix_jitter` tokens; no jitter draws no lengths, so the prompts
    of a seed stay what they were before jitter existed.
    """
    prompts: list[Prompt] = []
    for _ in range(groups):
        prefix = tokens.ids(prefix_len)
        prompts += [prefix + tokens.ids(tokens.length(suffix_len, suffix_jitter)) for _ in range(per_group)]
    order = list(range(len(prompts)))
    if shuffle:
        tokens.shuffle(order)
    return Step(
        name, tuple(prompts[i] for i in order), output_len, concurrency, groups=tuple(i // per_group for i in order)
    )


@dataclass(frozen=True)
class PrefixRepetitionScenario:
    """vLLM's `prefix_repetition` (defaults are vLLM's): one step, the whole dataset.

    Like vLLM, `num_requests` is rounded down to a multiple of `num_prefixes`.
    """

    name: ClassVar[str] = "prefix-repetition"
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128
    num_requests: int = 100
    concurrency: int = 1
    shuffle: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, "prefix_len", "suffix_len", "num_prefixes", "output_len", "concurrency")
        if self.num_requests < self.num_prefixes:
            raise ValueError(f"num_requests ({self.num_requests}) must be >= num_prefixes ({self.num_prefixes})")

    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len

    def steps(self, tokens: TokenSource) -> list[Step]:
        per_prefix = self.num_requests // self.num_prefixes
        name = (
            f"{self.num_prefixes}x{per_prefix} p{self.prefix_len}+s{self.suffix_len} "
            f"c{self.concurrency} out{self.output_len}"
        )
        return [
            _grouped_step(
                name,
                tokens,
                self.num_prefixes,
                per_prefix,
                self.prefix_len,
                self.suffix_len,
                self.shuffle,
                self.output_len,
                self.concurrency,
            )
        ]


@dataclass(frozen=True)
class SharedPrefixScenario:
    """sglang's `generated-shared-prefix` (defaults are sglang's; concurrency is ours)."""

    name: ClassVar[str] = "shared-prefix"
    groups: int = 64
    prompts_per_group: int = 16
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    concurrency: int = 16
    shuffle: bool = True
    # Questions are question_len +/- this many tokens (seeded; 0: all the same length).
    question_len_jitter: int = 0

    def __post_init__(self) -> None:
        _check_positive(
            self, "groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len", "concurrency"
        )
        if not 0 <= self.question_len_jitter < self.question_len:
            raise ValueError(
                f"SharedPrefixScenario.question_len_jitter must be in [0, question_len), got {self.question_len_jitter}"
            )

    def prompt_len(self) -> int:
        return self.system_prompt_len + self.question_len

    def steps(self, tokens: TokenSource) -> list[Step]:
        jitter = f"+-{self.question_len_jitter}" if self.question_len_jitter else ""
        name = (
            f"{self.groups}x{self.prompts_per_group} sys{self.system_prompt_len}+q{self.question_len}{jitter} "
            f"c{self.concurrency} out{self.output_len}"
        )
        return [
            _grouped_step(
                name,
                tokens,
                self.groups,
                self.prompts_per_group,
                self.system_prompt_len,
                self.question_len,
                self.shuffle,
                self.output_len,
                self.concurrency,
                self.question_len_jitter,
            )
        ]


@dataclass(frozen=True)
class MultiTurnScenario:
    """Multi-turn chat: conversations growing turn by turn, interleaved.

    Turn 1 of each conversation is its own system prompt plus a question; turn k is
    turn k-1's prompt, its answer and a new question, so every turn extends a prompt the
    decode engine has just served (prompt pulled, answer computed there). Questions are
    `question_len` tokens, +/- `question_len_jitter` (seeded): longer than a block by
    default, as real questions are. Within a turn the conversations go in order, at most
    `concurrency` at once; one step per turn, so each turn's hits are its own.
    """

    name: ClassVar[str] = "multi-turn"
    conversations: int = 4
    turns: int = 4
    system_prompt_len: int = 512
    question_len: int = 200
    question_len_jitter: int = 0
    output_len: int = 32
    concurrency: int = 1

    def __post_init__(self) -> None:
        _check_positive(
            self, "conversations", "turns", "system_prompt_len", "question_len", "output_len", "concurrency"
        )
        if not 0 <= self.question_len_jitter < self.question_len:
            raise ValueError(
                f"MultiTurnScenario.question_len_jitter must be in [0, question_len), got {self.question_len_jitter}"
            )

    def prompt_len(self) -> int:
        return self.system_prompt_len + self.question_len

    def steps(self, tokens: TokenSource) -> list[Step]:
        def question() -> Prompt:
            return tokens.ids(tokens.length(self.question_len, self.question_len_jitter))

        openings = tuple(tokens.ids(self.system_prompt_len) + question() for _ in range(self.conversations))
        steps = [Step("turn 1", openings, self.output_len, self.concurrency, turn=1)]
        for turn in range(2, self.turns + 1):
            questions = tuple(question() for _ in range(self.conversations))
            steps.append(Step(f"turn {turn}", questions, self.output_len, self.concurrency, turn=turn))
        return steps


def warmup_step(tokens: TokenSource, count: int, prompt_len: int, output_len: int = 2) -> Step:
    """`count` unrelated prompts: they warm engines and transports, never the measured prefixes."""
    return Step("warm-up", tuple(tokens.ids(prompt_len) for _ in range(max(count, 1))), output_len)
