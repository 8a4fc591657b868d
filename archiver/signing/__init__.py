"""Archive signatures in the OpenSSF model signing format (a Sigstore bundle over an in-toto
statement of every file's sha256), made at archiving and checked before unpacking.

Why not the ``model_signing`` library's API: it hashes a model folder on disk, for signing and
for verifying. An archive's digests are computed while it is written (archiver/writer.py) and
checked while it is unpacked (archiver/reader.py), so hashing a folder again would read every
byte twice, and verifying would need the archive unpacked first, which is what verification
must come before. The pieces that take precomputed digests are its private modules. So this
package writes the same format with the libraries under ``model_signing``: ``sigstore-models``
(the bundle's schema), ``cryptography`` (key and certificate signatures, certificate chains)
and ``sigstore`` (the keyless flow). An unpacked signed archive verifies with the
``model_signing`` tool as a signed model folder (tests/archiver/test_signing.py checks it).
"""

from archiver.signing.archive import (
    KEYLESS,
    SignatureCheck,
    SignFunction,
    check_signature,
    load_signer,
    sign_function,
)
from archiver.signing.payload import SIGNATURE_PATH
from archiver.signing.trust import TrustList

__all__ = [
    "KEYLESS",
    "SIGNATURE_PATH",
    "SignFunction",
    "SignatureCheck",
    "TrustList",
    "check_signature",
    "load_signer",
    "sign_function",
]
