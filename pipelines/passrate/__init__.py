"""Pass-rate filtering: answerer backends (Beam RunInference model handlers) and the pure rules of the filter.

The Beam stage itself is :mod:`longreel.pipelines.stages.passrate`; its config is :class:`longreel.pipelines.filter_config.FilterConfig`.
"""
