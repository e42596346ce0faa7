"""Word lists for the generated families: names with pronouns, and the false-belief lexicons.

Why these words: answer options are scored by their first token, and minimal pairs swap one word
for another, so option nouns and swapped words are single tokens (with a leading space) in the
SmolLM2 tokenizer that the embedded and tiny models share, and in most BPE vocabularies; the tests
check this for SmolLM2. Location and container nouns start with a consonant so "a"/"the" read
right in every slot. The lists are the project's own; none is taken from a paper's items.
"""

from __future__ import annotations

# (name, subject pronoun, object pronoun, possessive). Names are single common tokens in most
# tokenizers, which keeps minimal pairs aligned (an informed-protagonist pair swaps "nobody" for
# the protagonist's name).
NAMES: tuple[tuple[str, str, str, str], ...] = (
    ("Anna", "she", "her", "her"), ("Mark", "he", "him", "his"), ("Lucy", "she", "her", "her"),
    ("Tom", "he", "him", "his"), ("Emma", "she", "her", "her"), ("Jack", "he", "him", "his"),
    ("Sarah", "she", "her", "her"), ("David", "he", "him", "his"), ("Kate", "she", "her", "her"),
    ("Paul", "he", "him", "his"), ("Maria", "she", "her", "her"), ("Peter", "he", "him", "his"),
    ("Laura", "she", "her", "her"), ("James", "he", "him", "his"), ("Alice", "she", "her", "her"),
    ("John", "he", "him", "his"), ("Julia", "she", "her", "her"), ("Mike", "he", "him", "his"),
    ("Rose", "she", "her", "her"), ("Sam", "he", "him", "his"), ("Olivia", "she", "her", "her"),
    ("Ben", "he", "him", "his"), ("Lisa", "she", "her", "her"), ("Adam", "he", "him", "his"),
    ("Grace", "she", "her", "her"), ("Henry", "he", "him", "his"), ("Mary", "she", "her", "her"),
    ("Daniel", "he", "him", "his"), ("Helen", "she", "her", "her"), ("Chris", "he", "him", "his"),
    ("Jane", "she", "her", "her"), ("Steve", "he", "him", "his"),
)

# --- unexpected transfer -----------------------------------------------------------------------

# Small things a person puts away and later wants back.
TRANSFER_OBJECTS: tuple[str, ...] = (
    "ring", "key", "coin", "marble", "watch", "pen", "pencil", "phone", "wallet", "ball", "toy",
    "book", "glove", "hat", "apple", "cookie", "letter", "doll", "spoon", "ticket", "card",
    "candle", "sock", "necklace", "camera", "remote", "map", "brush", "comb", "whistle", "badge",
    "medal", "shell", "stone", "puzzle", "sandwich", "banana", "lemon", "flashlight", "charger",
    "notebook", "diary", "photo", "toothbrush",
)

# Places that hold such a thing and hide it from view when closed. Two of them per story.
TRANSFER_LOCATIONS: tuple[str, ...] = (
    "drawer", "box", "basket", "bag", "backpack", "chest", "bucket", "closet", "cabinet", "trunk",
    "sack", "bin", "purse", "jar", "pot", "vase", "tin", "bowl", "pouch", "safe", "hamper",
    "cooler", "toolbox", "tub",
)

# Rooms the two characters share (consonant-initial: "the"/"a" both read right).
ROOMS: tuple[str, ...] = (
    "kitchen", "bedroom", "garage", "basement", "living room", "hallway", "workshop", "studio",
    "cellar", "classroom", "playroom", "dining room",
)

# Where each character goes after the move (a phrase that follows "goes to").
PLACES: tuple[str, ...] = (
    "the gym", "work", "school", "the market", "the park", "the library", "the store",
    "the beach", "the pool", "the bank", "the post office", "the bakery", "the dentist",
    "the cinema", "a meeting", "band practice",
)

# --- unexpected contents -----------------------------------------------------------------------

# Opaque, labelled containers.
CONTAINERS: tuple[str, ...] = (
    "box", "tin", "jar", "bag", "pouch", "sack", "chest", "bucket", "packet", "tub", "case",
    "basket", "crate", "barrel", "carton",
)

# Contents and label words: plural count nouns ("there are no X"), single tokens, so the label
# and the contents can trade places (reversed versions) without changing the grammar.
CONTENTS: tuple[str, ...] = (
    "pencils", "buttons", "crayons", "marbles", "coins", "stamps", "beads", "nails", "screws",
    "shells", "cookies", "chocolates", "raisins", "peanuts", "almonds", "grapes", "cherries",
    "batteries", "keys", "spoons", "socks", "ribbons", "stickers", "matches", "candles", "sweets",
    "biscuits", "crackers", "olives", "candies", "pins", "needles", "clips", "cards", "rocks",
    "pebbles", "seeds", "beans", "chips", "bolts", "feathers", "gloves", "tissues", "photos",
    "letters", "jewels", "berries", "lemons", "apples", "eggs", "brushes", "medals", "toys",
)


def names_by_pronoun(pronoun: str) -> tuple[tuple[str, str, str, str], ...]:
    """The NAMES rows whose subject pronoun is `pronoun` ("she" or "he")."""
    return tuple(row for row in NAMES if row[1] == pronoun)


def article(word: str, capital: bool = False) -> str:
    """'a' or 'an' for a noun (by its first letter, which is right for every word listed here)."""
    a = "an" if word[:1].lower() in "aeiou" else "a"
    return a.capitalize() if capital else a
