package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// kafkaSecurity is how idemctl authenticates to Kafka and encrypts the
// connection: TLS (optionally with a client certificate) and SASL (PLAIN,
// SCRAM-SHA-256, SCRAM-SHA-512). Each setting is a flag, else its
// environment variable; the SASL password is only read from
// KAFKA_SASL_PASSWORD (a flag would show in ps).
type kafkaSecurity struct {
	tls           string // "", "true" or "false": --kafka-tls, else $KAFKA_TLS
	tlsCA         string // PEM file of the CAs to trust (default: the system's)
	tlsCert       string // PEM file of the client certificate (mutual TLS)
	tlsKey        string // PEM file of its key
	tlsServerName string // name to verify in the brokers' certificates
	saslMechanism string // PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
	saslUser      string
}

// kafkaEnv names the environment variable of each security flag.
var kafkaEnv = map[string]string{
	"kafka-tls":             "KAFKA_TLS",
	"kafka-tls-ca":          "KAFKA_TLS_CA",
	"kafka-tls-cert":        "KAFKA_TLS_CERT",
	"kafka-tls-key":         "KAFKA_TLS_KEY",
	"kafka-tls-server-name": "KAFKA_TLS_SERVER_NAME",
	"kafka-sasl-mechanism":  "KAFKA_SASL_MECHANISM",
	"kafka-sasl-user":       "KAFKA_SASL_USER",
}

func (k *kafkaSecurity) register(fs *flag.FlagSet) {
	fs.StringVar(&k.tls, "kafka-tls", k.tls, "`true` to connect to Kafka over TLS (default $KAFKA_TLS; implied by --kafka-tls-ca or --kafka-tls-cert)")
	fs.StringVar(&k.tlsCA, "kafka-tls-ca", k.tlsCA, "PEM `file` of the CAs that sign the brokers' certificates (default $KAFKA_TLS_CA, else the system's)")
	fs.StringVar(&k.tlsCert, "kafka-tls-cert", k.tlsCert, "PEM `file` of idemctl's client certificate, for mutual TLS (default $KAFKA_TLS_CERT; needs --kafka-tls-key)")
	fs.StringVar(&k.tlsKey, "kafka-tls-key", k.tlsKey, "PEM `file` of the client certificate's key (default $KAFKA_TLS_KEY)")
	fs.StringVar(&k.tlsServerName, "kafka-tls-server-name", k.tlsServerName, "`name` the brokers' certificates must hold (default $KAFKA_TLS_SERVER_NAME, else the broker's host)")
	fs.StringVar(&k.saslMechanism, "kafka-sasl-mechanism", k.saslMechanism, "SASL `mechanism`: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (default $KAFKA_SASL_MECHANISM; none)")
	fs.StringVar(&k.saslUser, "kafka-sasl-user", k.saslUser, "SASL `user` (default $KAFKA_SASL_USER); the password is read from $KAFKA_SASL_PASSWORD only")
}

// apply sets TLS and SASL on sc from the flags, else the environment. A bad
// setting (unknown mechanism, unreadable file, SASL without a user or a
// password) is a usage error.
func (k kafkaSecurity) apply(sc *sarama.Config, getenv func(string) string) error {
	or := func(v, flagName string) string {
		if v != "" {
			return v
		}
		return strings.TrimSpace(getenv(kafkaEnv[flagName]))
	}
	tlsOn, ca, cert, key, serverName := or(k.tls, "kafka-tls"), or(k.tlsCA, "kafka-tls-ca"), or(k.tlsCert, "kafka-tls-cert"), or(k.tlsKey, "kafka-tls-key"), or(k.tlsServerName, "kafka-tls-server-name")
	mech, user, pass := strings.ToUpper(or(k.saslMechanism, "kafka-sasl-mechanism")), or(k.saslUser, "kafka-sasl-user"), getenv("KAFKA_SASL_PASSWORD")

	enable := false
	if tlsOn != "" {
		b, err := strconv.ParseBool(tlsOn)
		if err != nil {
			return usageError("usage: --kafka-tls (or KAFKA_TLS) %q: want true or false", tlsOn)
		}
		enable = b
	}
	if ca != "" || cert != "" || key != "" || serverName != "" {
		if tlsOn != "" && !enable {
			return usageError("usage: --kafka-tls is false but TLS files or a server name are set")
		}
		enable = true
	}
	if enable {
		tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName}
		if ca != "" {
			pem, err := os.ReadFile(ca)
			if err != nil {
				return usageError("usage: --kafka-tls-ca: %v", err)
			}
			tc.RootCAs = x509.NewCertPool()
			if !tc.RootCAs.AppendCertsFromPEM(pem) {
				return usageError("usage: --kafka-tls-ca: %s holds no PEM certificate", ca)
			}
		}
		if (cert == "") != (key == "") {
			return usageError("usage: --kafka-tls-cert and --kafka-tls-key go together (mutual TLS)")
		}
		if cert != "" {
			pair, err := tls.LoadX509KeyPair(cert, key)
			if err != nil {
				return usageError("usage: --kafka-tls-cert/--kafka-tls-key: %v", err)
			}
			tc.Certificates = []tls.Certificate{pair}
		}
		sc.Net.TLS.Enable = true
		sc.Net.TLS.Config = tc
	}

	if mech == "" {
		if user != "" {
			return usageError("usage: --kafka-sasl-user (or KAFKA_SASL_USER) needs --kafka-sasl-mechanism (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)")
		}
		return nil
	}
	if user == "" || pass == "" {
		return usageError("usage: SASL %s needs --kafka-sasl-user (or KAFKA_SASL_USER) and KAFKA_SASL_PASSWORD", mech)
	}
	sc.Net.SASL.Enable = true
	sc.Net.SASL.Handshake = true
	sc.Net.SASL.User = user
	sc.Net.SASL.Password = pass
	switch mech {
	case sarama.SASLTypePlaintext:
		sc.Net.SASL.Mechanism = sarama.SASLTypePlaintext
	case sarama.SASLTypeSCRAMSHA256:
		sc.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA256
		sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{sha512: false} }
	case sarama.SASLTypeSCRAMSHA512:
		sc.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA512
		sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{sha512: true} }
	default:
		return usageError("usage: --kafka-sasl-mechanism (or KAFKA_SASL_MECHANISM) %q: want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", mech)
	}
	return nil
}

// scramClient is Sarama's SCRAM client over franz-go's SCRAM implementation
// (RFC 5802, the one kfake and real brokers are tested with): Sarama has
// none of its own.
type scramClient struct {
	sha512 bool
	sess   sasl.Session
	first  []byte
	done   bool
}

var _ sarama.SCRAMClient = (*scramClient)(nil)

func (c *scramClient) Begin(user, password, authzID string) error {
	auth := scram.Auth{User: user, Pass: password, Zid: authzID}
	mech := auth.AsSha256Mechanism()
	if c.sha512 {
		mech = auth.AsSha512Mechanism()
	}
	sess, first, err := mech.Authenticate(context.Background(), "")
	if err != nil {
		return err
	}
	c.sess, c.first = sess, first
	return nil
}

// Step returns the client-first message for the empty challenge Sarama
// starts with, then answers each server message.
func (c *scramClient) Step(challenge string) (string, error) {
	if c.sess == nil {
		return "", errors.New("scram: Step before Begin")
	}
	if c.first != nil {
		first := c.first
		c.first = nil
		return string(first), nil
	}
	done, resp, err := c.sess.Challenge([]byte(challenge))
	if err != nil {
		return "", fmt.Errorf("scram: %w", err)
	}
	c.done = done
	return string(resp), nil
}

func (c *scramClient) Done() bool { return c.done }
