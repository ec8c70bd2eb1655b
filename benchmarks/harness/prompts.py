"""Deterministic prompts: the same bytes on every side of a comparison and in every run.

Each measurement gets prompts that differ from their first content token on (a tag that
is never reused), so that no prefix cache holds more than the chat template's opening,
and prompts of one measurement have (near) equal token counts.
"""

from __future__ import annotations

import random

SYSTEM_TOPICS = [
    "astronomy",
    "botany",
    "cooking",
    "geology",
    "history",
    "music",
    "sailing",
    "chess",
    "poetry",
    "physics",
    "gardening",
    "weather",
    "painting",
    "railways",
    "bridges",
    "coffee",
]
QUESTIONS = [
    "Explain in a few paragraphs how tides are caused and why there are two a day.",
    "Describe in a few paragraphs how a bicycle stays upright while it is moving.",
    "Explain in a few paragraphs why the sky looks blue during the day and red at dusk.",
    "Describe in a few paragraphs how bread dough rises and what yeast is doing in it.",
    "Explain in a few paragraphs how a refrigerator moves heat out of its inside box.",
    "Describe in a few paragraphs how bees find flowers and tell each other where they are.",
    "Explain in a few paragraphs how a rainbow forms and why its colours are ordered.",
    "Describe in a few paragraphs how a steam engine turns heat into motion on rails.",
]


def make_messages(serial: int, idx: int) -> list[dict[str, str]]:
    """Distinct conversations of (near) equal token length.

    ``serial`` numbers the measurement (never reused, not even when a disturbed
    pair is measured again), so the leading tag makes every prompt differ from
    its first content token on: sluice's prefix cache can only reuse the
    template's opening ``<|im_start|>system\n`` (3 tokens), never a whole prompt.
    """
    tag = 100 + (serial * 8 + idx) % 900  # always 3 digits: same token count
    topic = SYSTEM_TOPICS[(serial * 5 + idx) % len(SYSTEM_TOPICS)]
    question = QUESTIONS[(serial * 3 + idx) % len(QUESTIONS)]
    return [
        {"role": "system", "content": f"{tag}. You are a patient tutor who likes {topic}."},
        {"role": "user", "content": question},
    ]


PEOPLE = ["Mara", "the old ferryman", "my neighbour Tomas", "the baker", "a young surveyor"]
PEOPLE += ["the harbour master", "my sister Ines", "a travelling musician", "the schoolteacher"]
PLACES = ["the lighthouse", "the river valley", "the village market", "the mountain railway"]
PLACES += ["the north meadow", "the stone bridge", "the abandoned mill", "the orchard", "the pier"]
THINGS = ["a brass compass", "a bundle of letters", "a wooden crate", "a faded map", "a lantern"]
THINGS += ["a basket of pears", "a broken clock", "a roll of canvas", "a ledger", "a small boat"]
ADJS = ["quiet", "restless", "cold", "golden", "grey", "crowded", "misty", "bright", "windy"]
TIMES = ["At dawn", "Later that morning", "Around noon", "In the afternoon", "Towards evening"]
TIMES += ["Long after dark", "On the second day", "A week later", "That same night"]
SENTENCES = [
    "{time} {person} went down to {place} carrying {thing}.",
    "The air around {place} was {adj}, and nobody could say why.",
    "{person} had promised to bring {thing} back before the bells rang.",
    "Everyone agreed that {place} looked different since the storm.",
    "{time} the road to {place} was {adj} and almost empty.",
    "Nobody expected {person} to care so much about {thing}.",
    "There was a rumour that {thing} had once belonged to {person}.",
    "{person} counted the steps from the gate to {place} twice, just to be sure.",
    "{time} a {adj} wind came off the water and rattled the shutters.",
    "The children asked {person} about {thing}, but got only a smile in return.",
    "It took three people to carry {thing} across {place}.",
    "{person} wrote everything down in a notebook with a {adj} cover.",
]


def sentence(rng: random.Random) -> str:
    """One story sentence, its blanks filled from ``rng``, capitalized."""
    s = rng.choice(SENTENCES).format(
        time=rng.choice(TIMES),
        person=rng.choice(PEOPLE),
        place=rng.choice(PLACES),
        thing=rng.choice(THINGS),
        adj=rng.choice(ADJS),
    )
    return s[0].upper() + s[1:]


def paragraph(rng: random.Random, words: int) -> str:
    """At least ``words`` words of a story, sentence by sentence, drawn from ``rng``."""
    out: list[str] = []
    while sum(len(s.split()) for s in out) < words:
        out.append(sentence(rng))
    return " ".join(out)
