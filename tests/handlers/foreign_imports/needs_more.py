"""An mlrun model class that also uses a part of mlrun mserve does not provide."""

from mlrun import get_dataitem
from mlrun.serving import V2ModelServer


class Remote(V2ModelServer):
    def load(self):
        self.table = get_dataitem("store://tables/x").as_df()

    def predict(self, request):
        return []
