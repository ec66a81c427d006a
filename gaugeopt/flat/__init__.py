"""The flat-direction meter: how many parameter directions leave a small model unchanged, and why.

* :mod:`.meter` — :func:`gaugeopt.flat_directions`: the measured nullity of the model's Jacobian;
* :mod:`.attribution` — the null space attributed to the symmetries gaugeopt knows;
* :mod:`.symmetries` — every known symmetry as a family of finite actions on one model;
* :mod:`.stream`, :mod:`.stream_sectors` — the residual stream (writers, norms, readers) and the
  symmetries that act across it;
* :mod:`.counting` — :func:`gaugeopt.gauge_dimension`: the symmetries counted from a model or its config;
* :mod:`.cost`, :mod:`.report` — what a run costs before it starts, and what it reports.
"""
