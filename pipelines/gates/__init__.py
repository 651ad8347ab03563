"""Question quality gates (issue 18): checks a question passes after it is written and before the expensive
pass-rate filter sees it. :mod:`.options`: balanced multiple-choice options (a seeded, recorded permutation);
:mod:`.blind`: the blind (text-only) answerability test. Pure functions here; the Beam stages that run them are
:mod:`longreel.pipelines.stages.blind` and the QRA stage's balance step."""
