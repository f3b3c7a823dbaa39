"""chunkgrpo.registry.promotion.promotion_lock against MLflow's create race: MLflow's create of a taken
name looks the holder up to word its error, and answers RESOURCE_DOES_NOT_EXIST when the holder released it
in between (nothing was created). Seen in a CI run: the better of two concurrent promoters failed."""

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

from chunkgrpo.registry.promotion import promotion_lock


class _Client:
    """A registry whose first create answers what MLflow's sqlalchemy store does in that race."""

    def __init__(self):
        self.models, self.creates = {}, 0

    def create_registered_model(self, name, tags=None, description=None):
        self.creates += 1
        if self.creates == 1:
            raise MlflowException(f"Registered Model with name={name} not found",
                                  error_code=RESOURCE_DOES_NOT_EXIST)
        self.models[name] = type("RM", (), {"tags": dict(tags or {})})()

    def get_registered_model(self, name):
        return self.models[name]

    def delete_registered_model(self, name):
        self.models.pop(name)


def test_a_lock_released_during_mlflows_create_is_taken_on_the_next_try():
    client = _Client()
    with promotion_lock(client, "m", timeout_s=5):
        assert "m.promotion-lock" in client.models and client.creates == 2
    assert client.models == {}  # released
