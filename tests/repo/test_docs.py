"""The documentation is tested: the README's and the guides' Python blocks run as written, the
site builds in strict mode, the README stays a short page for users, and the share of public
names whose docstrings document their arguments does not drop.

A Python block runs in one namespace with the blocks before it on the same page (as a reader
would run them). A block that cannot run here (it needs data not bundled with tf_dp's extras)
is preceded by the line ``<!-- not run: <reason> -->``; the reason must be given. A page holding
``<!-- docs-test: own process -->`` runs in a fresh interpreter (its code configures TensorFlow's
devices, which only works before TensorFlow initializes).
"""

import importlib
import importlib.util
import os
import inspect
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
DOC_PAGES = [page for page in [README, GETTING_STARTED, ROOT / "docs" / "guarantees.md"] + GUIDES if page.exists()]
BLOCK = re.compile(r"(<!-- not run: (?P<reason>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
README_MAX_LINES = 200
OWN_PROCESS = "<!-- docs-test: own process -->"


def python_blocks(page: pathlib.Path) -> list:
    """[(code, reason or None)] of the page's ```python blocks, in order."""
    return [(m["code"], m["reason"]) for m in BLOCK.finditer(page.read_text())]


def page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_documentation_page_has_runnable_python():
    """The README, Getting started and every guide show code (the guides list lives in docs/guides)."""
    assert GETTING_STARTED.exists() and len(GUIDES) >= 11, [page_id(p) for p in GUIDES]
    for page in [README, GETTING_STARTED] + GUIDES:
        if page.name == "tuning.md":
            continue  # the tuning guide's own tests cover it; its blocks still run below
        runnable = [code for code, reason in python_blocks(page) if reason is None]
        assert runnable, f"{page_id(page)} has no runnable ```python block"


def test_skipped_blocks_say_why():
    for page in DOC_PAGES:
        for code, reason in python_blocks(page):
            if reason is not None:
                assert len(reason.strip()) > 10, f"{page_id(page)}: a block opts out without a reason"


@pytest.mark.parametrize("page", [p for p in DOC_PAGES if python_blocks(p)], ids=page_id)
def test_python_blocks_compile(page):
    """Fast tier: every block is valid Python."""
    for code, _ in python_blocks(page):
        compile(code, page_id(page), "exec")


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in DOC_PAGES if python_blocks(p)], ids=page_id)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    """Each page's blocks run in order in one namespace, in a scratch directory (blocks may save
    files); a DP model left in the namespace reports a finite ε."""
    monkeypatch.chdir(tmp_path)
    if OWN_PROCESS in page.read_text():
        code = "\n".join(code for code, reason in python_blocks(page) if reason is None)
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        return
    namespace = {"__name__": "__docs__"}
    ran = 0
    for code, reason in python_blocks(page):
        if reason is not None:
            continue
        exec(compile(code, page_id(page), "exec"), namespace)  # noqa: S102
        ran += 1
    assert ran
    model = namespace.get("model")
    if model is not None and hasattr(model, "get_epsilon"):
        assert 0 < model.get_epsilon() < 10


def test_readme_is_a_short_page_for_users():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    dated = [line for line in lines if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, f"dated lines belong on docs/results.md: {dated}"
    chatter = [line for line in lines if re.search(r"\bload (average )?\d|\bloaded machine|\bissues? \d+", line, re.I)]
    assert not chatter, f"machine load / issue numbers in the README: {chatter}"
    for command in ("bash scripts/main.sh", "bash scripts/test.sh"):
        assert re.search(rf"^{re.escape(command)}$", text, re.M), f"README must show `{command}` on a line of its own"
    for guide in GUIDES:
        if guide.name != "tuning.md":
            assert f"docs/guides/{guide.name}" in text, f"the README's feature table does not link {guide.name}"


def test_readme_links_point_at_files():
    for target in re.findall(r"\]\(((?:docs/)[^)#\s]*)", README.read_text()):
        if target.endswith("tuning.md"):
            continue  # docs/guides/tuning.md comes with the tuning guide
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site built by `mkdocs build --strict` (a broken link, a missing page or an unresolved
    API reference fails the build)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None:
        pytest.skip('mkdocs / mkdocstrings-python not installed (pip install -e ".[docs]"; '
                    "scripts/install.sh --tests installs them)")
    assert (ROOT / "mkdocs.yml").exists(), "no mkdocs.yml: the documentation site is not configured"
    if not (ROOT / "docs" / "guides" / "tuning.md").exists():
        pytest.skip("docs/guides/tuning.md (the hyperparameter-tuning guide the nav links) is not in this tree yet")
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    yield site
    shutil.rmtree(site, ignore_errors=True)


@pytest.mark.slow
def test_the_site_builds_in_strict_mode(built_site):
    index = (built_site / "index.html").read_text()
    assert "Getting started" in index and "API reference" in index
    api = (built_site / "api" / "tf_dp" / "index.html").read_text()
    for name in ("tf_dp.DPModel", "tf_dp.DPSGD", "tf_dp.make_private", "tf_dp.PrivacyBudget"):
        assert f'id="{name}"' in api, f"the API reference has no entry for {name}"


def rendered_dom(browser: str, page: pathlib.Path) -> str:
    """The page's DOM after a headless Chromium has loaded it and run its scripts."""
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_the_site_renders_in_a_headless_browser(built_site):
    """The index, a guide and the API page, as Chromium renders them: title, navigation, an API entry."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no Chromium (Debian: apt-get install chromium; scripts/install.sh --tests does where apt is)")
    index = rendered_dom(browser, built_site / "index.html")
    assert "<title>tf_dp</title>" in index
    assert 'class="md-nav' in index and "Getting started" in index and "BandMF correlated noise" in index
    guide = rendered_dom(browser, built_site / "guides" / "bandmf" / "index.html")
    assert "BandMF: banded matrix-factorization correlated noise" in guide and 'class="md-nav' in guide
    api = rendered_dom(browser, built_site / "api" / "tf_dp" / "index.html")
    assert 'id="tf_dp.DPModel"' in api and "l2_norm_clip" in api


def test_result_files_named_on_the_results_page_exist():
    """docs/results.md names the JSON each figure came from; every name must be a file (or glob)."""
    text = (ROOT / "docs" / "results.md").read_text()
    names = re.findall(r"`(?:benchmarks/results/)?([A-Za-z0-9_./*]+\.(?:json|jsonl|md|png))`", text)
    assert len(names) > 20
    for name in names:
        found = (ROOT / name).exists() or list((ROOT / "benchmarks" / "results").glob(name))
        assert found, f"results.md names {name}: not found"


# -- docstring coverage: every public name documented ---------------------------------------------

PUBLIC_PACKAGES = ["tf_dp"] + [f"tf_dp.{name}" for name in (
    "accounting", "audit", "clipping", "data", "features", "filters", "models", "noise", "optimizers", "raco",
    "sampling", "tuning")]


def public_callables() -> dict:
    """{qualified public name: object} of every class and function in an ``__all__``, each object once."""
    found = {}
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and id(obj) not in {id(o) for o in found.values()}:
                found[f"{package}.{name}"] = obj
    return found


def takes_arguments(obj) -> bool:
    target = obj.__init__ if inspect.isclass(obj) else obj
    if inspect.isclass(obj) and not inspect.isfunction(target):
        return False  # the builtin object/Exception constructor: nothing of its own to document
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name not in ("self", "cls") for p in parameters)


def documents_its_arguments(obj) -> bool:
    """A docstring, with an Args (or, for a data class, Attributes) section if it takes arguments."""
    text = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and "__init__" in vars(obj):
        text += "\n" + (inspect.getdoc(obj.__init__) or "")
    if not text.strip():
        return False
    return not takes_arguments(obj) or bool(re.search(r"^\s*(Args|Attributes):", text, re.M))


def test_every_public_callable_has_a_docstring_with_args():
    """Every class and function in tf_dp's and its subpackages' ``__all__`` has a docstring, and
    an ``Args:`` (or ``Attributes:``) section when it takes arguments (the API reference's source)."""
    names = public_callables()
    assert "tf_dp.tuning.PrivateRandomSearch" in names and len(names) > 130, sorted(names)
    undocumented = sorted(name for name, obj in names.items() if not documents_its_arguments(obj))
    assert not undocumented, f"public names without a Google-style docstring (Args:): {undocumented}"


def undocumented_parameters(obj) -> list:
    """The parameters of ``obj`` (its ``__init__`` for a class) that its docstrings never name."""
    if not takes_arguments(obj):
        return []
    target = obj.__init__ if inspect.isclass(obj) else obj
    text = (inspect.getdoc(obj) or "") + "\n" + (
        inspect.getdoc(obj.__init__) or "" if inspect.isclass(obj) and "__init__" in vars(obj) else "")
    names = [p.name for p in inspect.signature(target).parameters.values() if p.name not in ("self", "cls")]
    return [name for name in names if not re.search(rf"\b{re.escape(name)}\b", text)]


def test_every_public_docstring_names_each_argument():
    missing = {name: params for name, obj in public_callables().items() if (params := undocumented_parameters(obj))}
    assert not missing, f"arguments no docstring describes: {missing}"
