"""Model registry on MLflow 3: register trained models, champion/challenger promotion, rollback.

    gate.py             the decision rules, pure (no MLflow): GateConfig, gate_decision, what is compared
    payload.py          the files of a registered version (MLflow pyfunc + MODEL_INFO), read by serving
    client.py           the MLflow connection and reads (bounded waits, identity, trusted metrics)
    promotion.py        the gate on MLflow tags, set_gate, promotion_lock, promote, rollback, history
    registration.py     register_model(Registration(...)), create_version (the promoter's half)
    promoter_client.py  HTTP client of the promoter service (chunkgrpo.promoter)
    load.py             load_pyfunc / load_registered_model / load_pipeline, verified

Import from the module that defines a name (`from chunkgrpo.registry.promotion import promote`); this
package re-exports nothing.
"""
