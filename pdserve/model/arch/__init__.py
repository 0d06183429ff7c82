"""One module per architecture family and the one registry naming them (`registry.py`):
for each Hugging Face architecture name, how its `config.json` is read (implemented
fields, refused ones) and the model class that computes it."""
