"""QRA (question-reasoning-answer) generation helpers: output JSON schemas, parsing and validation of
a reasoning LLM's raw text, and the training-target format. Everything here is pure Python without
model or Beam dependencies, so the QRA stage and the tests share exactly the same rules."""
