"""Beam resource hints on the model steps (captioning, QRA generation, blind filter, pass-rate answering, judge):
where they run.

Each model stage's config has a ``resources`` section (``caption.resources``, ``qra.resources``,
``blind.resources``, ``filter.resources``, and ``judge.resources`` of ``longreel judge``). Its hints go on that
stage's model step only (the ``RunInference`` or generation/answering ``ParDo``),
never on the decoding, joins or writes around it: Dataflow's right fitting then runs the model step on workers with
the accelerator and the rest of the pipeline on plain CPU workers, with a fusion break between them.

Default: no hint. Local runners ignore hints, so a default would change nothing here; on Dataflow it would make every
job ask for GPUs, including the CPU backends (facts, template, openai against a remote server) that need none, and
the accelerator type is a choice of the deployment (quota, region, price), not of the data. The README's Dataflow GPU
command sets them.
"""
from __future__ import annotations

from longreel.schemas.config import ConfigError, ConfigModel, cfg


#: the labels the stages give their model steps (``label >> on_model_step(...)``): the local forked workers split
#: the bundles of a stage that holds one over all workers (:mod:`longreel.pipelines.forked_workers`)
MODEL_STEPS = ("Caption", "WriteQRAs", "AnswerBlind", "Answer", "Judge")


class ResourceHints(ConfigModel):
    accelerator: str = cfg("", "Beam resource hint 'accelerator' on this stage's model step, in Dataflow's form, e.g. "
                               "'type:nvidia-l4;count:1;install-nvidia-driver'. '' = no hint. Local runners ignore it.")
    min_ram: str = cfg("", "Beam resource hint 'min_ram' on this stage's model step: least memory of a worker that "
                           "runs it, e.g. '32GB' or '16GiB'. '' = no hint.")

    def hints(self) -> dict[str, str]:
        """The hints that are set, as ``PTransform.with_resource_hints`` keywords."""
        return {k: v for k, v in (("accelerator", self.accelerator), ("min_ram", self.min_ram)) if v}

    def check(self):
        from apache_beam.transforms.resources import parse_resource_hints

        try:
            parse_resource_hints(self.hints())
        except ValueError as e:
            raise ConfigError(f"resources: {e}") from None


def on_model_step(transform, resources: ResourceHints):
    """``transform`` with ``resources``' hints (itself when none is set)."""
    hints = resources.hints()
    return transform.with_resource_hints(**hints) if hints else transform
