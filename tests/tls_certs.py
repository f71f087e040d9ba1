"""Throwaway PKI for the TLS tests: a CA and per-rank certificates, written as PEM files.

Made with the ``cryptography`` package where it is installed, else with the
``openssl`` command (``PYCOLLECT_TEST_CERTS=openssl`` forces the command).
"""

import datetime
import ipaddress
import os
import secrets
import shutil
import subprocess

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
except ImportError:
    x509 = None

USE_CLI = x509 is None or os.environ.get("PYCOLLECT_TEST_CERTS") == "openssl"
# Why certificates cannot be made here, or None.
MISSING = ("neither the cryptography package nor the openssl command is installed"
           if USE_CLI and shutil.which("openssl") is None else None)


def _is_ip(name):
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return path


class Authority:
    """A CA in ``directory`` that issues certificates for IP addresses and host names."""

    def __init__(self, directory, name="pycollect test CA"):
        self.directory = directory
        self.name = name
        base = os.path.join(directory, name.replace(" ", "-"))
        self.ca_file, self.key_file = base + "-ca.pem", base + "-ca-key.pem"
        if USE_CLI:
            self._openssl("req", "-x509", "-newkey", "ec", "-pkeyopt",
                          "ec_paramgen_curve:P-256", "-nodes", "-keyout", self.key_file,
                          "-out", self.ca_file, "-days", "1", "-subj", "/CN=" + name,
                          "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
                          "-addext", "keyUsage=critical,keyCertSign,cRLSign")
            return
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (x509.CertificateBuilder()
                     .subject_name(subject).issuer_name(subject)
                     .public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(
                         digital_signature=True, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=True, crl_sign=True, encipher_only=False,
                         decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        _write(self.ca_file, self.cert.public_bytes(serialization.Encoding.PEM))

    def _openssl(self, *args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30,
                       cwd=self.directory)

    def issue(self, label, names=("127.0.0.1",)):
        """A certificate for ``names`` (IP addresses or DNS names): (cert file, key file)."""
        base = os.path.join(self.directory, label)
        cert_file, key_file = base + "-cert.pem", base + "-key.pem"
        if USE_CLI:
            ext = _write(base + "-ext.cnf", ("subjectAltName=%s\nbasicConstraints=critical,"
                                             "CA:FALSE\n" % ",".join(
                                                 ("IP:" if _is_ip(n) else "DNS:") + n
                                                 for n in names)).encode())
            self._openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                          "-nodes", "-keyout", key_file, "-out", base + "-csr.pem",
                          "-subj", "/CN=" + label)
            self._openssl("x509", "-req", "-in", base + "-csr.pem", "-CA", self.ca_file,
                          "-CAkey", self.key_file, "-set_serial",
                          str(secrets.randbits(63)), "-days", "1", "-extfile", ext,
                          "-out", cert_file)
            return cert_file, key_file
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        alt = [x509.IPAddress(ipaddress.ip_address(n)) if _is_ip(n) else x509.DNSName(n)
               for n in names]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)]))
                .issuer_name(self.cert.subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(alt), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        _write(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        _write(key_file, key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        return cert_file, key_file
