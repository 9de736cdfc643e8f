"""The demo's training text: short village tales, generated from a small grammar with a
fixed seed and shipped as ``data/tales.txt`` (original text, no licence question; a
test regenerates it and compares). Structured enough for a tiny character-level model
to learn visibly in a few dozen steps."""

import random
from pathlib import Path

PATH = Path(__file__).parent / "data" / "tales.txt"
SEED = 1871
PARAGRAPHS = 400

_SUBJECTS = ["the miller", "a young fox", "the old queen", "my brother", "the ferryman", "a tired soldier",
             "the baker's daughter", "the north wind", "a grey heron", "the clockmaker", "the shepherd",
             "a quiet stranger"]
_VERBS = ["carried", "found", "watched", "mended", "followed", "lost", "painted", "sold", "counted",
          "remembered", "hid", "gave away"]
_OBJECTS = ["a lantern", "the broken wheel", "seven silver coins", "the long road", "a basket of apples",
            "the last letter", "an iron key", "the river stones", "a small blue boat", "the winter bread",
            "an old song", "the map of the valley"]
_PLACES = ["by the mill", "under the bridge", "at the edge of the forest", "in the market square", "on the hill",
           "beside the harbour", "near the chapel", "along the frozen lake"]
_TIMES = ["at dawn", "before the rain", "every evening", "in the spring", "after supper", "when the bells rang",
          "long ago", "at midnight"]
_SAYINGS = ["nothing is lost that is remembered", "the road is longer in the dark", "bread tastes best when shared",
            "the river keeps its own counsel", "a key is only as good as its door"]


def _sentence(rng: random.Random) -> str:
    s, v, o = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
    p, t = rng.choice(_PLACES), rng.choice(_TIMES)
    form = rng.randrange(4)
    if form == 0:
        text = f"{s} {v} {o} {p} {t}."
    elif form == 1:
        text = f"{t}, {s} {v} {o}."
    elif form == 2:
        saying = rng.choice(_SAYINGS)
        return f"\"{saying[0].upper()}{saying[1:]},\" said {s}."
    else:
        text = f"{s} and {rng.choice(_SUBJECTS)} {v} {o} {p}."
    return text[0].upper() + text[1:]


def generate(paragraphs: int = PARAGRAPHS, seed: int = SEED) -> str:
    rng = random.Random(seed)
    return "".join(" ".join(_sentence(rng) for _ in range(rng.randint(3, 6))) + "\n\n" for _ in range(paragraphs))


def load() -> str:
    return PATH.read_text(encoding="utf-8")
