"""The model organism: a small causal LM trained by tomlens on its own belief stories, so that the
methods can be checked on a model whose behaviour is known (`tomlens validate`).

`vocab` builds the word-level tokenizer, `data` the stories and their held-out split, `train` the
training loop and the folder it writes (weights, config, tokenizer, training record, model card).
The trained folder ships in `tomlens/models/weights/tom-organism` and loads as `tom-organism`.
"""
