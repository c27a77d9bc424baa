"""The structured synthetic corpus the tiny demo target is trained on (``tools/train_tiny_target.py``).

Each conversation is a system prompt, a user request and an assistant turn with a ``<think>`` reasoning and
an answer, written from templates: addition with carries, counting, repeating, reversing and sorting
lists, parity, comparing numbers, yes/no facts. Most of every response follows from the prompt
(copy the numbers, walk through them in order), so a model that has learnt the templates is very
predictable, and a drafter that reads the target's features can guess many tokens ahead, while one that
cannot see them (shuffled features) can guess only the fixed phrasing.

Everything is a pure function of a seed: ``examples(seed, n)`` gives the same list on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

SYSTEM = "You are a helpful assistant. Think step by step before you answer."

WORDS = (
    "red blue green yellow black white pink brown gray gold "
    "cat dog bird fish horse cow lion tiger bear mouse frog duck sheep goat wolf fox "
    "apple banana cherry grape lemon mango peach pear plum melon "
    "book chair table lamp cup door window pen clock phone shoe hat key ball box bed"
).split()

FRUIT_COLORS = {"apple": "red", "banana": "yellow", "cherry": "red", "grape": "purple", "lemon": "yellow",
                "mango": "orange", "peach": "orange", "pear": "green", "plum": "purple", "lime": "green",
                "kiwi": "brown", "melon": "green", "strawberry": "red", "blueberry": "blue", "coconut": "brown",
                "orange": "orange"}
COLORS = sorted(set(FRUIT_COLORS.values()) | {"black", "white", "pink", "gray"})
ANIMAL_SOUNDS = {"cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack", "sheep": "baa", "lion": "roar",
                 "frog": "ribbit", "owl": "hoot", "horse": "neigh", "pig": "oink", "bee": "buzz", "mouse": "squeak",
                 "snake": "hiss", "wolf": "howl", "goat": "bleat", "crow": "caw"}
ANIMALS = sorted(ANIMAL_SOUNDS)
SOUNDS = sorted(set(ANIMAL_SOUNDS.values()))


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    reasoning: str
    answer: str

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.prompt},
                {"role": "assistant", "content": self.answer, "reasoning_content": self.reasoning}]


def _join(xs) -> str:
    return ", ".join(str(x) for x in xs)


def add(r: random.Random) -> Example:
    a, b = r.randint(10, 99), r.randint(10, 99)
    prompt = r.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Compute the sum of {a} and {b}."]).format(a=a, b=b)
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10 + carry
    steps = [f"I need to add {a} and {b}.", f"First the ones: {a % 10} + {b % 10} = {ones}."]
    steps.append(f"I write {ones % 10} and carry 1." if carry else f"I write {ones}.")
    plus = " + 1" if carry else ""
    steps.append(f"Then the tens: {a // 10} + {b // 10}{plus} = {tens}.")
    steps.append(f"So {a} + {b} = {a + b}.")
    return Example("add", prompt, " ".join(steps), f"{a} + {b} = {a + b}.")


def count(r: random.Random) -> Example:
    s = r.randint(1, 60)
    e = s + r.randint(4, 12)
    if r.random() < 0.5:
        seq = list(range(s, e + 1))
        prompt = r.choice(["Count from {s} to {e}.", "List the numbers from {s} to {e}."]).format(s=s, e=e)
        how = f"I start at {s} and go up by one until I reach {e}."
    else:
        seq = list(range(e, s - 1, -1))
        prompt = r.choice(["Count down from {e} to {s}.", "List the numbers from {e} down to {s}."]).format(s=s, e=e)
        how = f"I start at {e} and go down by one until I reach {s}."
    reasoning = f"{how} That is {len(seq)} numbers. The first is {seq[0]} and the last is {seq[-1]}."
    return Example("count", prompt, reasoning, _join(seq) + ".")


def repeat(r: random.Random) -> Example:
    ws = r.sample(WORDS, r.randint(3, 7))
    prompt = r.choice(["Repeat these words: {w}.", "Say these words again: {w}."]).format(w=" ".join(ws))
    reasoning = (f"The user gave me {len(ws)} words: {_join(ws)}. I will say them again in the same order, "
                 f"starting with {ws[0]} and ending with {ws[-1]}.")
    return Example("repeat", prompt, reasoning, " ".join(ws))


def reverse(r: random.Random) -> Example:
    ws = r.sample(WORDS, r.randint(3, 7))
    rev = ws[::-1]
    prompt = r.choice(["Reverse the order of these words: {w}.", "Write these words backwards: {w}."]).format(
        w=" ".join(ws))
    reasoning = (f"The words are {_join(ws)}. The last word is {ws[-1]}, so it comes first, and the first word "
                 f"{ws[0]} comes last. Reversed, the list is {_join(rev)}.")
    return Example("reverse", prompt, reasoning, " ".join(rev))


def sort(r: random.Random) -> Example:
    xs = r.sample(range(1, 100), r.randint(4, 7))
    up = sorted(xs)
    prompt = r.choice(["Sort these numbers from smallest to largest: {x}.", "Put these numbers in order: {x}."]
                      ).format(x=" ".join(map(str, xs)))
    steps = [f"The numbers are {_join(xs)}.", f"The smallest is {up[0]}."]
    steps += [f"Next is {x}." for x in up[1:-1]]
    steps += [f"The largest is {up[-1]}.", f"So the sorted list is {_join(up)}."]
    return Example("sort", prompt, " ".join(steps), " ".join(map(str, up)))


def parity(r: random.Random) -> Example:
    n = r.randint(1, 999)
    d = n % 10
    kind = "even" if d % 2 == 0 else "odd"
    prompt = r.choice(["Is {n} even or odd?", "Is the number {n} odd or even?"]).format(n=n)
    reasoning = (f"A number is even when its last digit is even. The last digit of {n} is {d}. "
                 f"{d} is {kind}, so {n} is {kind}.")
    return Example("parity", prompt, reasoning, f"{n} is {kind}.")


def compare(r: random.Random) -> Example:
    a, b = r.sample(range(10, 100), 2)
    prompt = r.choice(["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?"]).format(a=a, b=b)
    big, small = max(a, b), min(a, b)
    if a // 10 != b // 10:
        why = f"Compare the tens digits: {a // 10} and {b // 10}. {big // 10} is larger"
    else:
        why = (f"The tens digits are both {a // 10}, so compare the ones digits: {a % 10} and {b % 10}. "
               f"{big % 10} is larger")
    reasoning = f"{why}, so {big} is larger than {small}."
    return Example("compare", prompt, reasoning, f"{big} is larger than {small}.")


def _fact(r: random.Random, task: str, table: dict[str, str], values: list[str], prompts: list[str], subject: str,
          verb: str) -> Example:
    """A yes/no question about ``table`` (asks the true value 40% of the time), answered with the true value."""
    key = r.choice(sorted(table))
    true = table[key]
    asked = true if r.random() < 0.4 else r.choice(values)
    prompt = r.choice(prompts).format(k=key, v=asked)
    subj = subject.format(k=key)
    reasoning = (f"The user asks whether {subj} {verb} {asked}. {subj[0].upper() + subj[1:]} {verb} {true}, "
                 + ("which is what was asked, so the answer is yes." if asked == true
                    else f"not {asked}, so the answer is no."))
    return Example(task, prompt, reasoning, f"{'Yes' if asked == true else 'No'}, {subj} {verb} {true}.")


def fruit_color(r: random.Random) -> Example:
    return _fact(r, "fruit", FRUIT_COLORS, COLORS, ["Is a ripe {k} {v}?", "Is the color of a ripe {k} {v}?"],
                 "a ripe {k}", "is")


def animal_sound(r: random.Random) -> Example:
    return _fact(r, "animal", ANIMAL_SOUNDS, SOUNDS, ["Does a {k} say {v}?", "Is {v} the sound a {k} makes?"],
                 "a {k}", "says")


TASKS: dict[str, Callable[[random.Random], Example]] = {
    f.__name__: f for f in (add, count, repeat, reverse, sort, parity, compare, fruit_color, animal_sound)
}


def examples(seed: int, n: int, exclude: set[str] | frozenset[str] = frozenset()) -> list[Example]:
    """``n`` examples with distinct prompts not in ``exclude``, the tasks in turn, from ``random.Random(seed)``.

    A task whose prompts run out (50 draws in a row already taken: the fact tasks have a few hundred) leaves
    the rotation."""
    r = random.Random(seed)
    active = list(TASKS.values())
    out: list[Example] = []
    seen = set(exclude)
    misses = 0
    while len(out) < n:
        if not active:
            raise ValueError(f"cannot find {n} distinct prompts outside the {len(exclude)} excluded ones")
        maker = active[len(out) % len(active)]
        ex = maker(r)
        if ex.prompt in seen:
            misses += 1
            if misses >= 50:
                active.remove(maker)
                misses = 0
            continue
        misses = 0
        seen.add(ex.prompt)
        out.append(ex)
    return out


def splits(seed: int, n_train: int, n_demo: int, n_heldout: int) -> tuple[list[Example], list[Example], list[Example]]:
    """Three prompt-disjoint sets: the target's training data, the demo's drafter data, held-out eval prompts."""
    train = examples(seed, n_train)
    seen = {e.prompt for e in train}
    demo = examples(seed + 1, n_demo, seen)
    seen |= {e.prompt for e in demo}
    heldout = examples(seed + 2, n_heldout, seen)
    return train, demo, heldout
