"""The release workflow publishes what the chart and the operator pull: every Dockerfile of docker/, under the
image names they default to, tagged with the version they carry."""

from __future__ import annotations

import yaml

from overlap.operator.spec import MODEL_IMAGE_REPOSITORY
from tests.support.cluster import REPO

WORKFLOW = yaml.safe_load((REPO / ".github" / "workflows" / "release.yml").read_text())


def test_every_dockerfile_is_built_and_pushed_under_the_names_the_defaults_pull():
    built = {
        entry["dockerfile"]: entry["name"] for entry in WORKFLOW["jobs"]["images"]["strategy"]["matrix"]["include"]
    }
    assert set(built) == {f"docker/{path.name}" for path in (REPO / "docker").glob("*Dockerfile")}
    values = yaml.safe_load((REPO / "charts" / "overlap" / "values.yaml").read_text())
    owner = "ghcr.io/overlap-dev"  # the repository's owner on GitHub: the workflow pushes to ghcr.io/<owner>/<name>
    pushed = {f"{owner}/{name}" for name in built.values()}
    assert {values["image"]["repository"], values["modelImage"]["repository"], MODEL_IMAGE_REPOSITORY} <= pushed


def test_a_release_checks_its_tag_against_the_chart_and_every_component():
    check = next(step for step in WORKFLOW["jobs"]["version"]["steps"] if step.get("id") == "check")["run"]
    components = [p.parent.name for p in REPO.glob("*/pyproject.toml")]
    assert components and all(name in check for name in components), components
    assert "Chart.yaml" in check
