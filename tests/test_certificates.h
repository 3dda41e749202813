// Certificates for the tests of security/ (tls_test, https_test), made with OpenSSL in the test.
#ifndef SHARDSERVE_TESTS_TEST_CERTIFICATES_H_
#define SHARDSERVE_TESTS_TEST_CERTIFICATES_H_

#include <string>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "security/certificates.h"

namespace shardserve {

// A CA (`is_ca`), or a leaf for 127.0.0.1 and localhost signed by `issuer` (self-signed when null),
// valid from now + `not_before` to now + `not_after` (by default from 5 minutes ago for a day; an
// expired one: -2h, -1h; one not valid yet: 1h, 2h). A failure is a test failure and an empty pair.
inline PemKeyPair MakeTestCertificate(const std::string& name, const PemKeyPair* issuer, bool is_ca = false,
                                      absl::Duration not_before = absl::Minutes(-5),
                                      absl::Duration not_after = absl::Hours(24)) {
  CertificateSpec spec;
  spec.common_name = name;
  spec.is_ca = is_ca;
  if (!is_ca) {
    spec.dns_names = {"localhost"};
    spec.ip_addresses = {"127.0.0.1"};
  }
  spec.not_before = not_before;
  spec.valid_for = not_after - not_before;
  absl::StatusOr<PemKeyPair> pair = MakeCertificate(spec, issuer);
  EXPECT_TRUE(pair.ok()) << pair.status();
  return pair.ok() ? *pair : PemKeyPair();
}

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_TEST_CERTIFICATES_H_
