package main_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/kfake"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// selfSigned returns a TLS certificate for 127.0.0.1 and the PEM file of
// the CA that signs it (itself), in dir.
func selfSigned(t *testing.T, dir string) (tls.Certificate, string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kfake"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:              []string{"kfake.test"},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	keyDER, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	pair, err := tls.X509KeyPair(certPEM, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}))
	require.NoError(t, err)
	caFile := filepath.Join(dir, "ca.pem")
	require.NoError(t, os.WriteFile(caFile, certPEM, 0o600))
	return pair, caFile
}

// idemctl speaks TLS and SASL (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) to
// Kafka, configured by flags or by the environment: poison list reads a
// poison topic on a kfake cluster that accepts only TLS connections
// authenticated by SASL. Without TLS, with a wrong password or an unknown
// mechanism it fails, and the password is never printed.
func TestPoisonOverTLSAndSASL(t *testing.T) {
	t.Parallel()
	if kafkatest.External() != nil {
		t.Skip("needs an in-process broker it can configure for TLS and SASL (KAFKA_BROKERS is set)")
	}
	dir := t.TempDir()
	cert, caFile := selfSigned(t, dir)
	const pw = "Kafka-s3cret"
	cluster, err := kafkatest.NewFake(
		kfake.TLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}),
		kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "plainuser", pw),
		kfake.Superuser("SCRAM-SHA-256", "scram256", pw),
		kfake.Superuser("SCRAM-SHA-512", "scram512", pw),
	)
	require.NoError(t, err)
	t.Cleanup(cluster.Close)
	brokers := cluster.ListenAddrs()

	// The test's own client: TLS + SASL PLAIN.
	sc := sarama.NewConfig()
	sc.Net.TLS.Enable = true
	sc.Net.TLS.Config = &tls.Config{RootCAs: x509.NewCertPool(), MinVersion: tls.VersionTLS12}
	ca, err := os.ReadFile(caFile)
	require.NoError(t, err)
	require.True(t, sc.Net.TLS.Config.RootCAs.AppendCertsFromPEM(ca))
	sc.Net.SASL.Enable, sc.Net.SASL.Mechanism, sc.Net.SASL.User, sc.Net.SASL.Password = true, sarama.SASLTypePlaintext, "plainuser", pw
	admin, err := sarama.NewClusterAdmin(brokers, sc)
	require.NoError(t, err)
	const topic = "orders.poison"
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false))
	require.NoError(t, admin.Close())
	pc, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: brokers, Sarama: sc})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
	require.NoError(t, err)
	msg := poisoned("orders", "permanent: unknown product", time.Now())
	require.NoError(t, pub.Publish(topic, msg))
	require.NoError(t, pub.Close())

	list := func(env []string, args ...string) result {
		return run(t, append([]string{"KAFKA_BROKERS=" + brokers[0], "KAFKA_SASL_PASSWORD=" + pw}, env...),
			append([]string{"poison", "list", "--topic", topic, "--json"}, args...)...)
	}
	for _, tc := range []struct {
		name string
		env  []string
		args []string
	}{
		{"env PLAIN", []string{"KAFKA_TLS_CA=" + caFile, "KAFKA_SASL_MECHANISM=PLAIN", "KAFKA_SASL_USER=plainuser"}, nil},
		{"env SCRAM-SHA-256", []string{"KAFKA_TLS=true", "KAFKA_TLS_CA=" + caFile, "KAFKA_SASL_MECHANISM=scram-sha-256", "KAFKA_SASL_USER=scram256"}, nil},
		{"flags SCRAM-SHA-512", nil, []string{"--kafka-tls-ca", caFile, "--kafka-tls-server-name", "kfake.test", "--kafka-sasl-mechanism", "SCRAM-SHA-512", "--kafka-sasl-user", "scram512"}},
		{"flags override env", []string{"KAFKA_TLS_CA=/nonexistent", "KAFKA_SASL_MECHANISM=PLAIN", "KAFKA_SASL_USER=nobody"},
			[]string{"--kafka-tls-ca", caFile, "--kafka-sasl-user", "plainuser"}},
	} {
		r := list(tc.env, tc.args...)
		require.Equal(t, 0, r.Code, "%s: %s", tc.name, r)
		p := decode[poisonListJSON](t, r)
		require.Equal(t, []string{eventIDOf(msg)}, p.eventIDs(), tc.name)
	}

	// Refused: no TLS, a wrong password, a certificate for another name;
	// bad settings are usage errors. The password is never printed.
	for _, tc := range []struct {
		name string
		code int
		env  []string
	}{
		{"no TLS", 1, []string{"KAFKA_SASL_MECHANISM=PLAIN", "KAFKA_SASL_USER=plainuser"}},
		{"wrong password", 1, []string{"KAFKA_TLS_CA=" + caFile, "KAFKA_SASL_MECHANISM=SCRAM-SHA-256", "KAFKA_SASL_USER=scram256", "KAFKA_SASL_PASSWORD=wrong-" + pw}},
		{"other server name", 1, []string{"KAFKA_TLS_CA=" + caFile, "KAFKA_TLS_SERVER_NAME=broker.example", "KAFKA_SASL_MECHANISM=PLAIN", "KAFKA_SASL_USER=plainuser"}},
		{"unknown mechanism", 2, []string{"KAFKA_TLS_CA=" + caFile, "KAFKA_SASL_MECHANISM=GSSAPI", "KAFKA_SASL_USER=plainuser"}},
		{"user without mechanism", 2, []string{"KAFKA_TLS_CA=" + caFile, "KAFKA_SASL_USER=plainuser"}},
		{"mechanism without password", 2, []string{"KAFKA_TLS_CA=" + caFile, "KAFKA_SASL_MECHANISM=PLAIN", "KAFKA_SASL_USER=plainuser", "KAFKA_SASL_PASSWORD="}},
		{"CA file without a certificate", 2, []string{"KAFKA_TLS_CA=" + filepath.Join(dir, "nothing.pem"), "KAFKA_SASL_MECHANISM=PLAIN", "KAFKA_SASL_USER=plainuser"}},
		{"TLS false with a CA", 2, []string{"KAFKA_TLS=false", "KAFKA_TLS_CA=" + caFile}},
	} {
		r := list(tc.env)
		require.Equal(t, tc.code, r.Code, "%s: %s", tc.name, r)
		require.NotContains(t, r.Stdout+r.Stderr, pw, tc.name)
		e := decode[errorJSON](t, r)
		require.Equal(t, tc.code, e.Code, tc.name)
	}
}
