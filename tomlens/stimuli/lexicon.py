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


# Plausible contents per container: a label word and the true contents are both drawn from the
# container's own list, so no story has "needles labelled grapes" (every word is in CONTENTS).
CONTAINER_CONTENTS: dict[str, tuple[str, ...]] = {
    "box": ("pencils", "crayons", "buttons", "matches", "candles", "cookies", "chocolates",
            "stickers", "cards", "photos", "letters", "toys", "tissues", "gloves", "candies"),
    "tin": ("cookies", "biscuits", "sweets", "buttons", "candies", "peanuts", "almonds", "pins",
            "beads", "stamps", "coins", "crackers", "chocolates"),
    "jar": ("sweets", "candies", "raisins", "peanuts", "almonds", "olives", "cherries", "buttons",
            "marbles", "beads", "coins", "pins", "seeds", "beans", "cookies", "nails", "screws"),
    "bag": ("chips", "sweets", "marbles", "peanuts", "apples", "lemons", "grapes", "cherries",
            "socks", "toys", "candies", "pebbles", "shells", "beans"),
    "pouch": ("coins", "beads", "seeds", "marbles", "jewels", "stamps", "keys", "pins", "buttons",
              "clips"),
    "sack": ("apples", "lemons", "beans", "rocks", "pebbles", "shells", "seeds", "peanuts"),
    "chest": ("jewels", "coins", "medals", "letters", "photos", "toys", "gloves", "socks",
              "ribbons"),
    "bucket": ("shells", "pebbles", "rocks", "apples", "eggs", "berries", "lemons", "sweets"),
    "packet": ("seeds", "sweets", "biscuits", "crackers", "stickers", "stamps", "chips", "raisins",
               "candies", "tissues", "clips", "pins", "needles", "cards"),
    "tub": ("sweets", "olives", "beads", "buttons", "crayons", "pencils", "marbles", "nails",
            "screws", "bolts", "clips", "cookies"),
    "case": ("pencils", "crayons", "brushes", "jewels", "medals", "cards", "keys", "photos"),
    "basket": ("apples", "lemons", "eggs", "berries", "grapes", "cherries", "cookies", "socks",
               "toys", "gloves"),
    "crate": ("apples", "lemons", "eggs", "toys", "rocks", "candles", "bolts"),
    "barrel": ("apples", "olives", "nails", "bolts", "rocks", "pebbles", "beans"),
    "carton": ("eggs", "crackers", "biscuits", "cookies", "candles", "batteries", "matches",
               "tissues"),
}

# A see-through container a contents story's protagonist may look into instead (a decoy: looking
# that decides nothing about the labelled container).
GLASS_CONTAINERS: tuple[str, ...] = ("jar", "bowl", "bottle", "vase")

# --- cue paraphrase pools ----------------------------------------------------------------------
# Eight phrasings of each cue that decides (or, in a decoy, seems to decide) what the protagonist
# knows, so that a probe trained on some phrasings can be tested on others. Index i of every pool
# belongs to cue group i: a task draws one group and uses that phrasing of every kind, so a split
# by group holds every phrasing out at once. Slots: {Pp} the protagonist's possessive, {Ao} the
# other agent's object pronoun, {H} who is told, {tgt} what is looked into.
CUE_POOLS: dict[str, tuple[str, ...]] = {
    # verb phrases after the protagonist's name: absent while the object is handled
    "absence": ("is away", "is asleep upstairs", "is out in the garden", "has {Pp} back turned",
                "is out of the room", "is in the shower", "is at the shops",
                "is on the phone next door"),
    # ... and present, seeing it
    "presence": ("is watching", "looks on", "stands beside {Ao}", "watches closely",
                 "is sitting right there", "keeps an eye on {Ao}", "sees it all",
                 "is looking straight at {Ao}"),
    # the other agent tells {H} (a name, "nobody", or "X, but not Y,"); only ways of telling that
    # reach someone who is elsewhere (an informed protagonist is away, e.g. "at the shops"), never
    # a whisper or showing, and the same pool in every condition so no word marks "informed"
    "told": ("phones {H} to say", "calls {H} to say", "texts {H} to say", "emails {H} to say",
             "messages {H} to say", "writes to {H} to say", "leaves a note for {H} saying",
             "sends a message to {H} saying"),
    # the protagonist looks into {tgt}
    "look": ("peeks inside {tgt}", "looks into {tgt}", "checks inside {tgt}", "glances into {tgt}",
             "peers into {tgt}", "takes a look inside {tgt}", "lifts the lid of {tgt}",
             "looks at what is in {tgt}"),
    # the label sentence of a contents story ({C} container, {LA} what it says, {LB} what not),
    # written naming the label's word first; `label_sentence` names it last in half the stories
    "label": ("The label on the {C} says {LA}, not {LB}.", "The {C} has a label that reads {LA}, not {LB}.",
              "The {C} is labelled {LA}, not {LB}.", "The {C} carries a label saying {LA}, not {LB}.",
              "Written on the {C} is {LA}, not {LB}.", "A sticker on the {C} says {LA}, not {LB}.",
              "The {C} is marked {LA}, not {LB}.", "The tag on the {C} reads {LA}, not {LB}."),
}
CUE_GROUPS = 8  # every pool has exactly this many phrasings
LABEL_FIRST, LABEL_LAST = "{LA}, not {LB}", "not {LB} but {LA}"


def label_sentence(group: int, label_last: bool) -> str:
    """The label phrasing of cue group `group`, naming the label's word last ("says not sweets but
    pins") when `label_last`: in a story cut after the label, the word named last is then the
    label's in half the stories and the other word in the others, so neither answers."""
    phrasing = CUE_POOLS["label"][group]
    return phrasing.replace(LABEL_FIRST, LABEL_LAST) if label_last else phrasing
