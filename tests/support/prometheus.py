"""Debian's prometheus on 127.0.0.1 with a scrape config of the test's, every second; stopped by PID."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.cluster import wait_for
from tests.support.sidecar import Proc, free_port, http

SCRAPE_S = 1


class Prometheus:
    def __init__(self, workdir: Path, scrape_config: dict) -> None:
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "scrape_configs": [scrape_config],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            "prometheus", f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]  # fmt: skip
        self.proc = Proc(cmd, workdir / "prometheus.log")
        wait_for(lambda: http("GET", f"{self.url}/-/ready", timeout=2)[0] == 200, 30, "Prometheus to be ready")

    @classmethod
    def of_targets(
        cls, workdir: Path, targets: dict[str, dict[str, str]], metrics_path: str = "/metrics"
    ) -> Prometheus:
        """Scraping fixed targets, each with its labels."""
        static = [{"targets": [target], "labels": labels} for target, labels in targets.items()]
        return cls(workdir, {"job_name": "overlap", "static_configs": static, "metrics_path": metrics_path})

    @classmethod
    def of_discovery_file(cls, workdir: Path, sd_file: Path) -> Prometheus:
        """Scraping what a file-based discovery file lists (re-read every second)."""
        sd_file.write_text("[]")
        return cls(
            workdir, {"job_name": "pods", "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}]}
        )

    def stop(self) -> None:
        self.proc.stop()
