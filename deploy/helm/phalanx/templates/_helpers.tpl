{{/* Chart name, overridable. */}}
{{- define "phalanx.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; the release name alone when it already contains the chart name. */}}
{{- define "phalanx.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "phalanx.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "phalanx.labels" -}}
helm.sh/chart: {{ include "phalanx.chart" . }}
{{ include "phalanx.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "phalanx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "phalanx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "phalanx.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The NATS URL workers use: the bundled server's Service, or the external one. */}}
{{- define "phalanx.natsUrl" -}}
{{- if .Values.nats.bundled.enabled }}
{{- printf "nats://%s-nats:4222" (include "phalanx.fullname" .) }}
{{- else }}
{{- required "nats.url is required unless nats.bundled.enabled" .Values.nats.url }}
{{- end }}
{{- end }}

{{/* The etcd host:port workers use: the bundled cluster's client Service (over every ready member), or the external
one (host:port, or every member as host:port,host:port,...). */}}
{{- define "phalanx.etcdEndpoint" -}}
{{- if .Values.etcd.bundled.enabled }}
{{- printf "%s-etcd:2379" (include "phalanx.fullname" .) }}
{{- else }}
{{- required "etcd.endpoint is required unless etcd.bundled.enabled" .Values.etcd.endpoint }}
{{- end }}
{{- end }}

{{/* A value as JSON for a PHALANX_* env var: a string is taken as JSON already, anything else is encoded. */}}
{{- define "phalanx.json" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/* The Secret holding the routers' API keys: the one named in values, or the chart's own; empty when there are none. */}}
{{- define "phalanx.routerApiKeysSecret" -}}
{{- if and .Values.router.apiKeysSecret .Values.router.apiKeys }}
{{- fail "set router.apiKeys or router.apiKeysSecret, not both" }}
{{- else if .Values.router.apiKeysSecret }}
{{- .Values.router.apiKeysSecret }}
{{- else if .Values.router.apiKeys }}
{{- printf "%s-router-api-keys" (include "phalanx.fullname" .) }}
{{- end }}
{{- end }}

{{/*
Mutual TLS (tls.enabled, docs/security.md): each component mounts the Secret of its identity at /etc/phalanx/tls
(tls.crt, tls.key, ca.crt: what a cert-manager Certificate writes) and reads it through PHALANX_TLS_DIR.
*/}}
{{- define "phalanx.tls.secretName" -}}
{{- $root := index . 0 }}{{- $identity := index . 1 }}
{{- printf "%s-%s-tls" (include "phalanx.fullname" $root) $identity | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "phalanx.tls.env" -}}
{{- if .Values.tls.enabled }}
- name: PHALANX_TLS_DIR
  value: /etc/phalanx/tls
- name: PHALANX_TLS_SERVER_NAME
  value: {{ .Values.tls.serverName | quote }}
{{- /* The same identity towards NATS and etcd when they serve TLS with the chart's CA (bundled, or said so). */}}
{{- if or .Values.etcd.bundled.enabled .Values.etcd.clientTls }}
- name: PHALANX_ETCD_TLS_DIR
  value: /etc/phalanx/tls
{{- end }}
{{- if or .Values.nats.bundled.enabled .Values.nats.clientTls }}
- name: PHALANX_NATS_TLS_DIR
  value: /etc/phalanx/tls
{{- end }}
{{- end }}
{{- end }}

{{/* The identities that serve (a server certificate besides the client one), and those that only call. */}}
{{- define "phalanx.tls.servers" -}}
router gateway worker expert-worker health migration checkpoint-store planner ert-manager encoder-pool
{{- end }}

{{/* Every identity the chart's certificate job issues (phalanx.common.tls: services, admin and client, etcd and nats). */}}
{{- define "phalanx.tls.identities" -}}
{{ include "phalanx.tls.servers" . }} admin client etcd nats
{{- end }}

{{/* DNS names of the bundled servers, for the etcd and nats certificates: clients dial the Services, etcd's members
each other by their stable names under the headless Service. */}}
{{- define "phalanx.tls.infraHosts" -}}
{{- $fullname := include "phalanx.fullname" . }}
{{- printf "%s-etcd *.%s-etcd-peers %s-nats" $fullname $fullname $fullname }}
{{- end }}

{{- define "phalanx.tls.volumeMount" -}}
{{- if .Values.tls.enabled }}
- name: phalanx-tls
  mountPath: /etc/phalanx/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The pod volume of identity (list $ "router"). */}}
{{- define "phalanx.tls.volume" -}}
{{- $root := index . 0 }}
{{- if $root.Values.tls.enabled }}
- name: phalanx-tls
  secret:
    secretName: {{ include "phalanx.tls.secretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}
