"""The gate every gauge operation passes: records checked and proved for the model as it is now.

* :mod:`.gate` — :class:`~gaugeopt.trust.gate.Gate` (one pass, kept honest by a snapshot re-check)
  and :func:`gaugeopt.assume_certified`;
* :mod:`.static_checks` — hooks, parametrizations, shared tensors, patched code: refused before any write;
* :mod:`.proof` — :func:`gaugeopt.certify`: each record's sectors proved numerically on the module's own call;
* :mod:`.stamps` — which records carry a proof, and for which module state;
* :mod:`.capture` — recording a real forward's calls for a proof made later;
* :mod:`.examples` — inputs gaugeopt can make up for the models it knows;
* :mod:`.invariance` — generic random parameters, so that no check passes by accident.

docs/trust.md says what is checked, what is proved and what it costs.
"""
