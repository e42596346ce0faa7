"""Shared word lists: protagonist names with pronouns. Family-specific lexicons live beside them."""

from __future__ import annotations

# (name, subject pronoun, object pronoun, possessive). Names are single common tokens in most
# tokenizers, which keeps minimal pairs aligned.
NAMES: tuple[tuple[str, str, str, str], ...] = (
    ("Anna", "she", "her", "her"), ("Mark", "he", "him", "his"), ("Lucy", "she", "her", "her"),
    ("Tom", "he", "him", "his"), ("Emma", "she", "her", "her"), ("Jack", "he", "him", "his"),
    ("Sarah", "she", "her", "her"), ("David", "he", "him", "his"), ("Kate", "she", "her", "her"),
    ("Paul", "he", "him", "his"), ("Maria", "she", "her", "her"), ("Peter", "he", "him", "his"),
    ("Laura", "she", "her", "her"), ("James", "he", "him", "his"), ("Alice", "she", "her", "her"),
    ("John", "he", "him", "his"), ("Julia", "she", "her", "her"), ("Mike", "he", "him", "his"),
    ("Rose", "she", "her", "her"), ("Sam", "he", "him", "his"), ("Nora", "she", "her", "her"),
    ("Ben", "he", "him", "his"), ("Lisa", "she", "her", "her"), ("Adam", "he", "him", "his"),
    ("Grace", "she", "her", "her"), ("Henry", "he", "him", "his"), ("Mary", "she", "her", "her"),
    ("Daniel", "he", "him", "his"), ("Helen", "she", "her", "her"), ("Chris", "he", "him", "his"),
    ("Jane", "she", "her", "her"), ("Steve", "he", "him", "his"),
)
