"""TLS for the control plane: a cluster whose daemons serve and dial gRPC over TLS (one CA, made
here with openssl) trains; a client that does not trust the CA, or speaks plaintext, is refused."""

import shutil
import subprocess

import pytest

import atoll
from tests import models

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a CA"),
]


def _ca(directory, name):
    key, cert = directory / f"{name}-ca.key", directory / f"{name}-ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
         "-days", "2", "-subj", f"/CN={name} test CA"],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def _leaf(directory, ca_key, ca_cert):
    key, csr, cert = directory / "daemon.key", directory / "daemon.csr", directory / "daemon.pem"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    subprocess.run(
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=atoll"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "2", "-extfile", ext],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def test_a_tls_cluster_trains_and_refuses_clients_without_its_ca(tmp_path):
    ca_key, ca = _ca(tmp_path, "cluster")
    key, cert = _leaf(tmp_path, ca_key, ca)
    _, other_ca = _ca(tmp_path, "other")
    model, batches, loss_fn = models.mlp()
    x, y = batches[0]
    with atoll.LocalCluster(workers=2, tls=(str(ca), str(cert), str(key))) as cluster:
        with cluster.client() as client:  # trusts the cluster's CA
            with client.pipeline(
                model, example_input=x, example_target=y, loss_fn=loss_fn, stages=2, microbatches=2
            ) as job:
                assert job.step(x, y) > 0
        for refused in ({}, {"tls_ca": str(other_ca)}):  # plaintext, another CA: refused as connect checks
            with pytest.raises(atoll.AtollError, match="unreachable|UNAVAILABLE|handshake|deadline"):
                atoll.connect(cluster.address, cluster.token, timeout_s=5, **refused)
