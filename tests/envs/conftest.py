"""The tiny model the environment tests roll out with (builtin:tiny-arith: its own chat template, no tools)."""

from tests.model_fixtures import model_fixtures

tokenizer, model = model_fixtures("builtin:tiny-arith")
