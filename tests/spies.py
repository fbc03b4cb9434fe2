"""Counting what the core asks of an adapter, for the "costs nothing on a clean step"
tests (core tests on the fake backend, contract tests on the real ones)."""


def record_calls(monkeypatch, backend, log=None):
    """Wraps every public adapter method so that each call appends its name to ``log``
    (a new list if None), which is returned; ``monkeypatch.undo()`` removes the spies."""
    log = [] if log is None else log
    for name in dir(backend):
        method = getattr(backend, name)
        if name.startswith("_") or not callable(method):
            continue

        def spy(*args, _name=name, _method=method, **kwargs):
            log.append(_name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(backend, name, spy)
    return log
